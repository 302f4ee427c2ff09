"""Benchmark the transposition methods on matrix containers: in-process best/median of R runs, and the file stage.

usage: python bench.py OUT.json MATRIX.h5 [...]   (env THREADS="1 2", METHODS="scantrans scipy cusparse", R=5)
"""
import json, os, platform, resource, sys, time
import numpy as np
from mlemlib.formats.h5 import MatrixH5
from mlemlib import transpose as T

out = sys.argv[1]
threads = [int(t) for t in os.environ.get("THREADS", "1 2").split()]
methods = os.environ.get("METHODS", "scantrans scipy").split()
R = int(os.environ.get("R", "5"))
T.warm_up()
if "cusparse" in methods:
    T.cusparse_warm_up()
res = {"host": platform.node(), "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M"), "runs": []}
for path in sys.argv[2:]:
    a = MatrixH5(path).to_csr()
    ref = T.scipy_transpose(a)
    for method in methods:
        for th in (threads if method == "scantrans" else [None]):
            ts = []
            for _ in range(R):
                timing = {}
                t0 = time.perf_counter()
                if method == "scantrans":
                    t = T.scantrans(a, threads=th, chunk_nnz=None)
                elif method == "scipy":
                    t = T.scipy_transpose(a)
                else:
                    t = T.cusparse_transpose(a, timing=timing)
                ts.append(timing.get("seconds", time.perf_counter() - t0))
            same = all(np.array_equal(getattr(t, k), getattr(ref, k)) for k in ("indptr", "indices", "data"))
            row = {"matrix": os.path.basename(path), "shape": list(a.shape), "nnz": a.nnz, "method": method,
                   "threads": th, "best_s": min(ts), "median_s": float(np.median(ts)), "identical_to_scipy": same,
                   "load": os.getloadavg()[0]}
            print(json.dumps(row), flush=True)
            res["runs"].append(row)
    del a, ref, t
    for method in methods:
        info = T.transpose_file(path, path + f".{method}.t.h5", method, threads=max(threads) if method == "scantrans" else None)
        info["matrix"] = os.path.basename(path)
        print(json.dumps(info), flush=True)
        res["runs"].append({"stage": info})
        os.remove(path + f".{method}.t.h5")
res["maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
json.dump(res, open(out, "w"), indent=1)
