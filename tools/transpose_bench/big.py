"""One stage on a big matrix, in its own process; print its summary and the process's peak RSS.

usage: python big.py STEP DIR   (STEP: generate, convert, transpose, norm, partition)
"""
import json, logging, os, resource, sys, time
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
step, d = sys.argv[1], sys.argv[2]
t0 = time.time()
if step == "generate":
    from mlemlib.scanner import generate
    out = generate("madpet2", f"{d}/madpet2.csr4")
elif step == "convert":
    from mlemlib.formats import convert
    out = convert(f"{d}/madpet2.csr4", f"{d}/matrix.h5")
    os.remove(f"{d}/madpet2.csr4")
elif step == "transpose":
    from mlemlib.transpose import transpose_file
    out = transpose_file(f"{d}/matrix.h5", f"{d}/transpose.h5", "scantrans")
elif step == "norm":
    from mlemlib.norm import compute_norm
    n = compute_norm(f"{d}/matrix.h5", f"{d}/norm.h5")
    out = {"n": n.size, "sum": float(n.sum()), "zeros": int((n == 0).sum())}
elif step == "partition":
    from mlemlib.partition import partition_file
    p = partition_file(f"{d}/matrix.h5", f"{d}/transpose.h5", 4, f"{d}/parts-4")
    out = {k: p[k] for k in ("parts", "imbalance", "transpose_imbalance", "rows", "nnz_per_part", "transpose_rows")}
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print(json.dumps({"step": step, "wall_s": round(time.time() - t0, 1), "peak_rss_GiB": round(rss, 2),
                  "summary": {k: v for k, v in out.items() if k != "scanner"}}, default=str), flush=True)
