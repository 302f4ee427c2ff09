"""The back projection on A^T beside a stand-in of the thesis code's kernel, in one run on one GPU.

Usage (repository root on the device; ``python3 -m mlemlib generate --preset madpet2 -o /tmp/m2.h5`` first)::

    PYTHONPATH=. python3 tools/thesis_standin_probe.py /tmp/m2.h5 --out $OUT/standin.json [--repeat 60]
    PYTHONPATH=. ncu --profile-from-start off --clock-control none --set full --csv --page details \
        python3 tools/thesis_standin_probe.py /tmp/m2.h5 --out $OUT/p.json --profile > $OUT/ncu.csv

The thesis code's figures (issue 13: the back projection on A^T 1.92 ms on an H200, 2.71 on an H100) were
taken on other machines than ours; H200s differ by a few percent (power capping, docs/benchmarks.md section 84).
This probe puts a kernel with the thesis code's facts on the same GPU, in the same run:

- ``thesis stand-in``: one warp per row, 1024-thread blocks, one row per warp (no grid-stride loop), a block
  barrier after the row, a 32-bit row pointer, scalar loads in column order (lane ``l`` takes elements ``s + l``,
  ``s + l + 32``, ...), the row's partial sums through shared memory, added to a zeroed output with an atomic.
  Written here from those facts (seed 000, chapter 5); its output is zeroed inside the timed call, as its
  iteration must. Its sums are in another order than ours: compared with a float64 product only.
- ``library``: ``csr_vector`` on A^T in the interleaved layout at the shape a backend tunes (``bp plain``), and
  with the update fused (``bp fused``); the forward projection with the correlation over the non-empty rows
  (``fp``) beside the stand-in's and cuSPARSE's plain forward.
- ``csr_row``: the library's ``csr_row_L`` (section 86) under each shape a backend tunes it at, and ``csr_block``
  ``512t w0 stream`` (the back projection's shape before it), through the library's launch;
- ``warp_scalar``: our sums (``group_dot<32>`` on the interleaved layout, bit for bit) from A^T in column order
  with the stand-in's scalar loads, at 32 registers (64 warps per multiprocessor, as the stand-in).
- cuSPARSE (``A^T @ c``, ``A @ f``) on copies in column order.

Times: CUDA events, medians of ``repeat``, every variant of an operation in turn, two rounds (the second in
reverse order). Every output is checked: the library's variants bit for bit, all against a float64 product.
The NVML power-cap counter is read before and after. ``--profile`` runs each back projection once between
cudaProfilerStart and Stop (for ``ncu``) and stops.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: The thesis code's csr_vector kernel as its facts describe it (seed 000, chapter 5; written for this probe).
STANDIN = r"""
extern "C" __global__ void __launch_bounds__(1024) standin_csr_vector(
        const unsigned* rowptr, const unsigned* col, const float* val, const float* x, float* y, unsigned m) {
    __shared__ float part[1024];
    const unsigned lane = threadIdx.x & 31u;
    const unsigned warps = blockDim.x / 32u * gridDim.x;
    for (unsigned r = (blockIdx.x * blockDim.x + threadIdx.x) / 32u; r < m; r += warps) {
        const unsigned s = rowptr[r], e = rowptr[r + 1];
        float acc = 0.0f;
        for (unsigned k = s + lane; k < e; k += 32u) acc += val[k] * x[col[k]];
        part[threadIdx.x] = acc;
        __syncwarp();
        if (lane == 0) {
            float t = part[threadIdx.x];
            for (unsigned i = 1; i < 32u; ++i) t += part[threadIdx.x + i];
            atomicAdd(y + r, t);
        }
        __syncthreads();
    }
}
"""

#: csr_vector_32's sums (group_dot<32> on the interleaved layout, bit for bit) from A in column order with
#: scalar loads: a warp's load instruction reads 32 consecutive elements (128 bytes), as the stand-in's do.
#: One warp per row, one row per warp (no grid-stride loop); direct write, no atomic.
WARP_SCALAR = r"""
typedef long long i64;
#ifdef WS_STREAM
#define LDM(p) __ldcs(p)
#else
#define LDM(p) __ldg(p)
#endif
extern "C" __global__ void __launch_bounds__(WS_THREADS, WS_MINB) warp_scalar(
        const i64* __restrict__ rowptr, const int* __restrict__ col, const float* __restrict__ val,
        const float* __restrict__ x, float* __restrict__ y, i64 m) {
    const i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (r >= m) return;
    const i64 s = rowptr[r];
    const int len = (int)(rowptr[r + 1] - s);
    const int* __restrict__ cr = col + s;
    const float* __restrict__ vr = val + s;
    // Offsets from the row's start: a = s rounded up to a multiple of 4, q4 = e rounded down.
    const int a = (int)(((s + 3) & ~(i64)3) - s);
    const int q4 = (int)((((s + len) >> 2) << 2) - s);
    float sum = 0.0f;
    const int head_end = a < len ? a : len;
    if (lane < head_end) sum += LDM(vr + lane) * __ldg(x + LDM(cr + lane));
    int b = a;
    if (q4 > a) {
        const int full_end = a + ((q4 - a) >> 7 << 7);
#pragma unroll WS_UNROLL
        for (; b < full_end; b += 128) {
            const int k = b + lane;
            const int c0 = LDM(cr + k), c1 = LDM(cr + k + 32), c2 = LDM(cr + k + 64), c3 = LDM(cr + k + 96);
            const float v0 = LDM(vr + k), v1 = LDM(vr + k + 32), v2 = LDM(vr + k + 64), v3 = LDM(vr + k + 96);
            const float x0 = __ldg(x + c0), x1 = __ldg(x + c1), x2 = __ldg(x + c2), x3 = __ldg(x + c3);
            sum += v0 * x0;
            sum += v1 * x1;
            sum += v2 * x2;
            sum += v3 * x3;
        }
        const int Q = (q4 - b) >> 2;  // the last trip's quads (< 32)
        if (lane < Q) {
            const int k = b + lane;
            const int c0 = LDM(cr + k), c1 = LDM(cr + k + Q), c2 = LDM(cr + k + 2 * Q), c3 = LDM(cr + k + 3 * Q);
            const float v0 = LDM(vr + k), v1 = LDM(vr + k + Q), v2 = LDM(vr + k + 2 * Q), v3 = LDM(vr + k + 3 * Q);
            sum += v0 * __ldg(x + c0);
            sum += v1 * __ldg(x + c1);
            sum += v2 * __ldg(x + c2);
            sum += v3 * __ldg(x + c3);
        }
    }
    const int t = (q4 > a ? q4 : a) + lane;
    if (t < len) sum += LDM(vr + t) * __ldg(x + LDM(cr + t));
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (lane == 0) y[r] = sum;
}
"""

#: (threads, blocks of 1024 threads per multiprocessor (its register cap), unroll, streaming loads) of
#: warp_scalar.
SCALARS = ((1024, 2, 4, True), (1024, 2, 1, False))

#: The csr_row_L shapes a backend tunes over (mlemlib.backends._cuda_plan.SHAPE_CANDIDATES), and csr_block_L's
#: 512t w0 stream (the back projection's tuned shape before csr_row_L): timed besides the tuned ``library`` launch.
def _shapes():
    from mlemlib.backends import _cuda_plan as plan
    return [sh for sh in plan.SHAPE_CANDIDATES if sh.row_bound], plan.RowShape(512, False, 0, True)


ROW_SHAPES, BLOCK_512 = _shapes()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("matrix")
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeat", type=int, default=100)
    ap.add_argument("--profile", action="store_true",
                    help="run each back projection once between cudaProfilerStart and Stop (for ncu), then stop")
    args = ap.parse_args()

    import cupy as cp

    from mlemlib.backends import _cuda_kernels as ck
    from mlemlib.backends import _cuda_plan as plan
    from mlemlib.bench import copy_bandwidth, time_gpu_interleaved
    from mlemlib.devices import EnergyMeter, capped_between
    from mlemlib.formats import open_source
    from tools.row_order_probe import probe_vectors

    meter = EnergyMeter([0])
    cap0 = meter.capped()
    with open_source(args.matrix, "matrix") as src:
        a = ck.load_device(src)
    at = a.transpose()
    m, n = a.shape
    # Column-order copies for the stand-in and cuSPARSE (the timed pair keeps its interleaved layout).
    a_cols = ck.DeviceCSR(a.indptr, a.indices.copy(), a.data.copy(), a.shape)
    at_cols = ck.DeviceCSR(at.indptr, at.indices.copy(), at.data.copy(), at.shape)
    la, lt = a.lanes(), ck.transpose_lanes(at)
    ck.set_row_layouts(a, at, "csr_vector", "csr_vector", la, lt, True)
    shape_a, shape_t = a.tune(la), at.tune(lt)
    props = ck.device_properties(cp.cuda.Device().id)
    f, norm, g, c = probe_vectors(cp, a)
    res = {"device": props["name"], "copy": copy_bandwidth(), "shape": [m, n], "nnz": a.nnz,
           "lanes": {"a": la, "at": lt}, "tuned": {"fp": shape_a.label(), "bp": shape_t.label()}, "ops": {},
           "warp_scalar_regs": {}}
    print(f"{props['name']}: {args.matrix}: {m} x {n}, {a.nnz} nnz; lanes {la} / {lt}; tuned fp {shape_a.label()}, "
          f"bp {shape_t.label()}; copy {res['copy']}", flush=True)

    def standin(mat, x):
        sm = cp.RawModule(code=STANDIN, options=("--std=c++17",)).get_function("standin_csr_vector")
        ptr32 = mat.indptr.astype(cp.uint32)
        col32 = mat.indices.view(cp.uint32)
        out = cp.zeros(mat.shape[0], cp.float32)
        blocks = -(-mat.shape[0] // 32)
        kargs = (ptr32, col32, mat.data, x, out, np.uint32(mat.shape[0]))

        def call():
            out.fill(0)
            sm((blocks,), (1024,), kargs)
            return out
        return call

    def warp_scalar(mat, x, threads, minb, unroll, stream):
        opts = ("--std=c++17", "-DWS_THREADS=1024", f"-DWS_MINB={minb}",
                *(("-DWS_STREAM",) if stream else ()))
        src = WARP_SCALAR.replace("WS_UNROLL", str(unroll))
        fn = cp.RawModule(code=src, options=opts).get_function("warp_scalar")
        out = cp.zeros(mat.shape[0], cp.float32)
        blocks = -(-mat.shape[0] // (threads // 32))
        kargs = (mat.indptr, mat.indices, mat.data, x, out, np.int64(mat.shape[0]))
        res["warp_scalar_regs"][f"{threads}t mb{minb} u{unroll}{' stream' if stream else ''}"] = fn.num_regs

        def call():
            fn((blocks,), (threads,), kargs)
            return out
        return call

    def cusparse(mat, x):
        sp = mat.cusparse()
        out = cp.empty(mat.shape[0], cp.float32)

        def call():
            out[...] = sp @ x
            return out
        return call

    rows_fp = a.launch_rows(True)
    outs = {}

    def buf(key, size):
        return outs.setdefault(key, cp.zeros(size, cp.float32))

    ops = {
        "bp plain": {"library": ck.spmv_launch(at, c, buf("bpl", n), lanes=lt, shape=shape_t),
                     "thesis stand-in": standin(at_cols, c), "cusparse": cusparse(at_cols, c)},
        "bp fused": {"library": ck.spmv_launch(at, c, buf("bpf", n), lanes=lt, mode=ck.MODE_UPDATE, aux0=f,
                                               aux1=norm, shape=shape_t)},
        "fp": {"library": ck.spmv_launch(a, f, buf("fpl", m), lanes=la, mode=ck.MODE_CORR, aux0=g, shape=shape_a,
                                         skip_empty=True),
               "thesis stand-in (plain)": standin(a_cols, f), "cusparse (plain)": cusparse(a_cols, f)},
    }
    for sh in ROW_SHAPES:  # csr_row_L through the library's launch, whatever the tuning picked
        key = f"csr_row {sh.label()}"
        ops["bp plain"][key] = ck.spmv_launch(at, c, buf("p" + key, n), lanes=lt, shape=sh)
        ops["bp fused"][key] = ck.spmv_launch(at, c, buf("f" + key, n), lanes=lt, mode=ck.MODE_UPDATE, aux0=f,
                                              aux1=norm, shape=sh)
        if la in plan.BLOCK_LANES:
            ops["fp"][key] = ck.spmv_launch(a, f, buf("a" + key, m), lanes=la, mode=ck.MODE_CORR, aux0=g, shape=sh,
                                            skip_empty=True)
    for sh in (BLOCK_512,):
        key = f"csr_block {sh.label()}"
        ops["bp plain"][key] = ck.spmv_launch(at, c, buf("p" + key, n), lanes=lt, shape=sh)
        ops["bp fused"][key] = ck.spmv_launch(at, c, buf("f" + key, n), lanes=lt, mode=ck.MODE_UPDATE, aux0=f,
                                              aux1=norm, shape=sh)
    for threads, minb, unroll, stream in SCALARS:
        key = f"warp_scalar {threads}t mb{minb} u{unroll}{' stream' if stream else ''}"
        ops["bp plain"][key] = warp_scalar(at_cols, c, threads, minb, unroll, stream)

    if args.profile:
        for fn in ops["bp plain"].values():  # warm up (compile) outside the profiled range
            fn()
        cp.cuda.Device().synchronize()
        cp.cuda.profiler.start()
        for k, fn in ops["bp plain"].items():
            if "cusparse" not in k:
                fn()
        cp.cuda.Device().synchronize()
        cp.cuda.profiler.stop()
        print("profiled: " + ", ".join(k for k in ops["bp plain"] if "cusparse" not in k))
        return 0
    ref = {op: fns["library"]().copy() for op, fns in ops.items()}
    at64 = at_cols.cusparse().astype(cp.float64)
    bp64 = at64 @ c.astype(cp.float64)
    del at64
    a64 = a_cols.cusparse().astype(cp.float64)
    fp64 = a64 @ f.astype(cp.float64)
    del a64
    g64 = g.astype(cp.float64)
    corr64 = cp.where(fp64 != 0, g64 / cp.where(fp64 != 0, fp64, 1.0), 0.0)
    exact = {"bp plain": bp64, "bp fused": bp64 * f.astype(cp.float64) / norm.astype(cp.float64), "fp": corr64}

    def rel(name, v, op):
        e = fp64 if op == "fp" and "plain" in name else exact[op]
        return float(cp.linalg.norm(v.astype(cp.float64) - e) / cp.linalg.norm(e))

    for op, fns in ops.items():
        names = list(fns)
        outs_now = {k: fns[k]().copy() for k in names}
        same = {k: bool(cp.array_equal(outs_now[k], ref[op])) for k in names}
        err = {k: rel(k, outs_now[k], op) for k in names}
        rounds = [time_gpu_interleaved([fns[k] for k in names], repeat=args.repeat),
                  time_gpu_interleaved([fns[k] for k in names[::-1]], repeat=args.repeat)[::-1]]
        res["ops"][op] = {k: {"ms": [float(np.median(r[i])) * 1e3 for r in rounds],
                              "median_ms": float(np.median(np.concatenate([r[i] for r in rounds]))) * 1e3,
                              "same_bits": same[k], "rel_l2_float64": err[k]} for i, k in enumerate(names)}
        for k, v in sorted(res["ops"][op].items(), key=lambda kv: kv[1]["median_ms"]):
            print(f"{op:9s} {k:34s} {v['median_ms']:.4f} ms (rounds {v['ms'][0]:.4f} / {v['ms'][1]:.4f}) "
                  f"same bits {v['same_bits']!s:5s} rel L2 {v['rel_l2_float64']:.2e}", flush=True)
    res["power_capped_s"] = capped_between(cap0, meter.capped())
    res["copy_after"] = copy_bandwidth()
    print(f"power capped during the probe: {res['power_capped_s']}; copy after {res['copy_after']}")
    meter.close()
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
