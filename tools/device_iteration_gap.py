"""Where one MLEM iteration's time goes beyond its two kernels (issue 13), on one GPU.

``mlem bench spmv`` timed the fused ``csr_vector`` iteration on ``madpet2``
(own order, H100) at 5.413 ms, 113 us more than its forward and back
projections timed alone (2.664 + 2.636 ms, benchmarks.md section 54). This
script takes the difference apart on the same matrix, in one process:

- ``synced``: iterations as ``bench`` and ``reconstruct`` ran them until now
  (the times of each read before the next is submitted: the GPU waits for
  the host between iterations), with the step times of each;
- ``pipelined``: iterations submitted back to back, the times read at the
  end (events between the calls);
- each fused kernel alone back to back (as ``bench`` times kernels), and the
  unfused ones;
- the launch latency: the fused forward submitted to an idle GPU.

``--profile`` runs one iteration and the plain kernels between
cudaProfilerStart and Stop, for Nsight Compute::

    ncu --profile-from-start off --clock-control none --set full -o $OUT/it \
        python3 tools/device_iteration_gap.py --profile --out /tmp/gap.json

Run on the device from the repository root::

    PYTHONPATH=. python3 tools/device_iteration_gap.py --out $OUT/gap.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import device_kernels as dk  # noqa: E402


def _ms(t) -> dict:
    t = np.asarray(t, dtype=np.float64) * 1e3
    return {"median_ms": float(np.median(t)), "min_ms": float(t.min()), "max_ms": float(t.max())}


def measure(be, f, R: int):
    """One round of every timing below on the backend ``be`` (the kernels compiled now); the image after it."""
    import cupy as cp

    from mlemlib.backends import _cuda_kernels as ck
    from mlemlib.bench import time_gpu

    res: dict = {}
    for _ in range(3):
        f = be.iterate(f)
        be.last_step_times()

    # synced, as bench and reconstruct: the host reads each iteration's times before the next
    synced: dict[str, list] = {}
    host_s = []
    for _ in range(R):
        t0 = time.perf_counter()
        f = be.iterate(f)
        host_s.append(time.perf_counter() - t0)
        for k, v in be.last_step_times().items():
            synced.setdefault(k, []).append(v)
    res["synced"] = {k: _ms(v) for k, v in synced.items()}
    res["host_submit"] = _ms(host_s)

    # pipelined: submitted back to back, an event between two calls
    ev = [cp.cuda.Event() for _ in range(R + 1)]
    be.synchronize()
    ev[0].record()
    for i in range(R):
        f = be.iterate(f)
        ev[i + 1].record()
    ev[-1].synchronize()
    res["pipelined"] = _ms([cp.cuda.get_elapsed_time(ev[i], ev[i + 1]) / 1e3 for i in range(R)])

    # each kernel alone, back to back
    first = be._fused_fp_launch(f)
    res["alone_fp_fused"] = _ms(time_gpu(first, repeat=R))
    c = be._c.copy()
    res["alone_fp_plain"] = _ms(time_gpu(lambda: be.forward(f), repeat=R))
    out = cp.empty_like(f)
    res["alone_bp_fused"] = _ms(time_gpu(
        lambda: be._project(be.at, c, out, be.bp_kernel, mode=ck.MODE_UPDATE, aux0=f, aux1=be.norm), repeat=R))
    res["alone_bp_plain"] = _ms(time_gpu(lambda: be.back(c), repeat=R))

    # launch latency: the fused forward submitted to an idle GPU, events around it
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    lat = []
    for _ in range(R):
        be.synchronize()
        e0.record()
        first()
        e1.record()
        e1.synchronize()
        lat.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
    res["idle_fp_fused"] = _ms(lat)
    return f, res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rays", type=int, default=81)
    ap.add_argument("--repeat", type=int, default=100)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ab", type=Path, help="another spmv.cu to alternate with this tree's, in rounds")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--profile", action="store_true",
                    help="instead: after 3 iterations, one iteration (its two fused kernels) and the plain forward "
                         "and back projections between cudaProfilerStart and Stop, for "
                         "`ncu --profile-from-start off`")
    ap.add_argument("--shapes", action="store_true",
                    help="instead: the pipelined iteration and the back projection alone under each launch shape "
                         "of A^T's csr_vector (the tuner's candidates), in rounds, the order reversed every other")
    args = ap.parse_args(argv)

    import cupy as cp

    from mlemlib.backends import _cuda_kernels as ck
    from mlemlib.backends.cuda import CudaBackend
    from mlemlib.bench import copy_bandwidth

    R = args.repeat
    host, _ = dk.trace(args.rays)
    a, at = dk.build(host, "own")
    del host
    m, n = a.shape
    g, norm = dk.problem(a, at)
    cp.get_default_memory_pool().free_all_blocks()
    copy = copy_bandwidth()
    res: dict = {"matrix": {"shape": [m, n], "nnz": int(a.nnz), "bytes_a": int(a.nbytes), "bytes_at": int(at.nbytes)},
                 "copy": copy}
    res["floor_ms"] = (a.nbytes + at.nbytes) / copy["bandwidth"] * 1e3

    be = CudaBackend(a, g, norm, at, fp="auto", bp="auto", device=0)
    res["backend"] = be.describe()
    f = be.initial_image()
    if args.profile:  # the kernels as the iteration runs them, then alone without their epilogues
        for _ in range(3):
            f = be.iterate(f)
        be.synchronize()
        cp.cuda.profiler.start()
        f = be.iterate(f)
        c = be._c.copy()
        be.forward(f)
        be.back(c)
        be.synchronize()
        cp.cuda.profiler.stop()
    elif args.shapes:
        from mlemlib.backends import _cuda_plan as plan
        from mlemlib.bench import time_gpu

        res["tuned_bp"] = dict(getattr(be.at, "tuned", {}) or {})
        res["picked_bp"] = (be.at.row_shape or plan.RowShape()).label()
        picked = be.at.row_shape
        shapes = list(plan.SHAPE_CANDIDATES)
        rows: dict[str, list] = {}
        for i in range(args.rounds):
            for sh in shapes if i % 2 == 0 else shapes[::-1]:
                be.at.row_shape = None if sh.is_default else sh
                f = be.iterate(f)
                be.last_step_times()
                ev = [cp.cuda.Event() for _ in range(R + 1)]
                ev[0].record()
                for k in range(R):
                    f = be.iterate(f)
                    ev[k + 1].record()
                ev[-1].synchronize()
                it = float(np.median([cp.cuda.get_elapsed_time(ev[k], ev[k + 1]) for k in range(R)]))
                c = be._c.copy()
                alone = float(np.median(time_gpu(lambda: be.back(c), repeat=R))) * 1e3
                rows.setdefault(sh.label(), []).append({"iteration_ms": it, "bp_alone_ms": alone})
        be.at.row_shape = picked
        res["shapes"] = {k: {"iteration_ms": float(np.median([r["iteration_ms"] for r in v])),
                             "bp_alone_ms": float(np.median([r["bp_alone_ms"] for r in v])), "rounds": v}
                         for k, v in rows.items()}
        for k, v in res["shapes"].items():
            print(f"{k:32s} iteration {v['iteration_ms']:.4f} ms  bp alone {v['bp_alone_ms']:.4f} ms")
        print("tuner:", res["tuned_bp"], "->", res["picked_bp"])
    elif args.ab is None:
        f, part = measure(be, f, R)
        res.update(part)
    else:  # this tree's kernels and another spmv.cu, alternated in rounds (the GPU's drift hits both)
        own = ck.kernel_source("spmv")
        other = args.ab.read_text()
        res["rounds"] = {"this": [], "other": []}
        for i in range(args.rounds):
            pair = (("this", own), ("other", other))
            for name, text in pair if i % 2 == 0 else pair[::-1]:  # ABBA: a drift hits both alike
                ck.kernel_source = lambda mod, _t=text, _k=ck.kernel_source: _t if mod == "spmv" else _k(mod)
                ck.module.cache_clear()
                ck._function_on.cache_clear()
                f, part = measure(be, f, R)
                res["rounds"][name].append(part)
        res["summary"] = {name: {k: float(np.median([p[k]["median_ms"] for p in parts])) for k in parts[0]
                                 if "median_ms" in parts[0][k]}
                          for name, parts in res["rounds"].items()}
        res["summary"]["synced_iteration"] = {
            name: float(np.median([p["synced"]["iteration"]["median_ms"] for p in parts]))
            for name, parts in res["rounds"].items()}
    res["image_finite"] = bool(cp.isfinite(f).all())

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
