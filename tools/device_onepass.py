#!/usr/bin/env python3
"""Probe of the atomic scatter and the one-pass iteration on ``madpet2`` (one GPU): what limits them.

Run from the repository root on a GPU machine::

    PYTHONPATH=. python3 tools/device_onepass.py --out $OUT [--rays 81] [--repeat 15] [--orders own,own-reordered] [--ncu]
    PYTHONPATH=. python3 tools/device_onepass.py --out $OUT --orders own-reordered --library-only --chunked 8192,16384

For each LOR order (as ``tools/device_kernels.py``: ``own``, ``shuffled``,
``X-reordered``) it times with CUDA events (median of ``--repeat`` after a
warm-up), next to the measured copy bandwidth, cuSPARSE and the library's
kernels:

- the back projection without ``A^T``: the library's ``scatter``,
  ``cusparse_notrans``, and the probe kernels of ``tools/onepass_probe.cu``
  (one warp per row, no grid-stride loop, 256 or 1024 threads; scalar or
  warp-aggregated 16-byte vector atomics);
- the one-pass iteration: the library's ``onepass`` (CSR and compressed,
  atomics and fixed point) and the probe's CSR variants (trips cached in
  registers, scalar or aggregated atomics, fixed point);
- the CSR pair (``csr_vector`` fused, tuned launch shapes) and cuSPARSE's pair;
- with ``--chunked 8192,16384``: the one pass through a :mod:`mlemlib.chunked`
  plan of each window (probe kernels ``pchunk2_onepass_<C>``: the library's
  ``chunked_onepass`` body with C = 0, 8, 16 trips in registers; one block per
  chunk, ``f`` and the chunk's split fixed-point sums in shared memory, one
  global atomic per distinct voxel of a chunk; ``--chunk-old`` adds the first
  version with float shared-memory atomics), built on the host from the
  matrix in that order (use a ``-reordered`` order: that is where chunks reuse
  voxels).

Every result is checked against a float64 reference first (relative L2).
Writes ``onepass.json`` and ``onepass.md`` under ``--out``; ``--ncu`` then
profiles the main variants with Nsight Compute into ``ncu_onepass.txt``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

PROBE_CACHES = (0, 8, 12, 16, 20)
#: The chunked probe kernel timed: the library's first body (one element per lane, 8 trips in registers;
#: 0 and 16 trips were slower, and so were variants that batch a long row's tail or load the next row
#: early: docs/benchmarks.md section 34, probe commit a02006a), next to the library's kernel.
PCHUNK_VARIANTS = ("pchunk2_onepass_8",)
THREADS = (256, 512)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def probe_module(threads: int):
    """compressed.cu's helpers plus tools/onepass_probe.cu, built for ``threads`` per block."""
    import cupy as cp

    from mlemlib.backends import _compressed_cuda as gpu

    lib = gpu.kernel_source()
    lib = lib[: lib.index("// Entry points.")]
    src = lib + (ROOT / "tools" / "onepass_probe.cu").read_text()
    mod = cp.RawModule(code=src, options=("--std=c++17", f"-DPROBE_THREADS={threads}"))
    mod.compile()
    return mod


def timer(repeat: int):
    """Median milliseconds of ``repeat`` CUDA-event-timed calls after one warm-up (:func:`mlemlib.bench.time_gpu`)."""
    from mlemlib.bench import time_gpu

    return lambda fn: float(np.median(time_gpu(fn, repeat=repeat, warmup=1))) * 1e3


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in TB/s (:func:`mlemlib.bench.copy_bandwidth`, a 1 GiB buffer, 10 copies)."""
    from mlemlib.bench import copy_bandwidth as measure

    return measure(1 << 30, repeat=10)["bandwidth"] / 1e12


def rel(a, ref) -> float:
    import cupy as cp

    d = float(cp.linalg.norm(a.astype(cp.float64) - ref))
    return d / max(float(cp.linalg.norm(ref)), 1e-300)


def order_section(host, order: str, args, mods, records: list) -> None:
    import cupy as cp
    import cupyx.scipy.sparse as cps

    import device_kernels as dk
    from mlemlib.backends import _compressed_cuda as gpu
    from mlemlib.backends import _cuda_kernels as ck
    from mlemlib.compressed import CompressedMatrix

    a, at = dk.build(host, order)
    m, n = a.shape
    nnz = a.nnz
    bw = copy_bandwidth()
    run = timer(args.repeat)
    rng = np.random.default_rng(3)
    f = cp.asarray(rng.uniform(0.5, 1.5, n).astype(np.float32))
    truth = cp.asarray(rng.uniform(0.0, 2.0, n).astype(np.float32))
    g = ck.spmv(a, truth)
    a64 = cps.csr_matrix((a.data.astype(cp.float64), a.indices, a.indptr.astype(cp.int32)), shape=a.shape)
    fp64 = a64 @ f.astype(cp.float64)
    c64 = cp.where(fp64 > 0, g.astype(cp.float64) / cp.where(fp64 > 0, fp64, 1.0), 0.0)
    bp64 = a64.T @ c64
    c = c64.astype(cp.float32)
    sc64 = a64.T @ c.astype(cp.float64)  # the scatter's reference: A^T of the float32 c
    del a64
    cp.get_default_memory_pool().free_all_blocks()
    one_read = (a.indptr.nbytes + a.indices.nbytes + a.data.nbytes) / (bw * 1e12) * 1e3
    log(f"{order}: {m} x {n}, {nnz} nnz; copy bandwidth {bw:.3f} TB/s; one read of A {one_read:.3f} ms")
    fp = cp.empty(m, dtype=cp.float32)
    bp = cp.empty(n, dtype=cp.float32)
    y = cp.empty(m, dtype=cp.float32)

    probes = {} if args.library_only else {t: mods[t] for t in THREADS}  # the probe variants

    def rec(kind: str, name: str, fn, check) -> None:
        try:
            ms = run(fn)
            err = check()
        except Exception as exc:  # a variant that fails is reported, not fatal
            log(f"{order}: {kind} {name}: FAILED {type(exc).__name__}: {exc}")
            records.append({"order": order, "kind": kind, "name": name, "error": str(exc)})
            return
        records.append({"order": order, "kind": kind, "name": name, "ms": ms, "rel_l2": err,
                        "copy_bw_TBps": bw, "one_read_ms": one_read, "nnz": nnz})
        log(f"{order}: {kind:9s} {name:44s} {ms:8.3f} ms  rel.L2 {err:.1e}")

    # the CSR pair (csr_vector fused, tuned shapes) and cuSPARSE's pair
    lanes_a, lanes_t = a.lanes(), at.lanes()
    a.tune(lanes_a)
    at.tune(lanes_t)

    def pair():
        ck.spmv(a, f, y, mode=ck.MODE_CORR, aux0=g)
        ck.spmv(at, y, bp)

    rec("pair", f"csr_vector fused ({a.row_shape and a.row_shape.label()} / {at.row_shape and at.row_shape.label()})",
        pair, lambda: rel(bp, bp64))
    sa, sat = a.cusparse(), at.cusparse()

    def cpair():
        y[...] = sa @ f
        ck.correlate(g, y, y)
        bp[...] = sat @ y

    rec("pair", "cuSPARSE", cpair, lambda: rel(bp, bp64))
    at.drop_cusparse()
    del sat
    rec("bp_notrans", "cusparse_notrans", lambda: ck.scatter(a, c, bp, kernel="cusparse_notrans"),
        lambda: rel(bp, sc64))
    a.drop_cusparse()
    del sa
    rec("bp_notrans", "scatter_32 (library, 256t)", lambda: ck.scatter(a, c, bp, kernel="scatter", lanes=32),
        lambda: rel(bp, sc64))
    for threads, mod in probes.items():
        blocks = (-(-m * 32 // threads),)
        for agg in (0,):
            fn = mod.get_function(f"pscat_csr_{agg}")

            def go(fn=fn, blocks=blocks, threads=threads):
                bp.fill(0)
                fn(blocks, (threads,), (a.indptr, a.indices, a.data, c, bp, np.int64(m)))

            rec("bp_notrans", f"pscat agg={agg} {threads}t", go, lambda: rel(bp, sc64))
    # one pass: library (the fixed-point bound computed once, outside the timed calls)
    bound = 4 * float(bp64.max())
    for det in (False, True):
        rec("onepass", f"library onepass csr {'fixed' if det else 'atomics'}",
            lambda det=det: gpu.onepass(a, g, f, bp=bp, fp=fp, deterministic=det, bound=bound, check=False),
            lambda: rel(bp, bp64))
    scale = gpu.fixed_scale(bound)
    acc = cp.empty(n, dtype=cp.uint64)
    flag = cp.zeros(1, dtype=cp.int32)
    variants = [(f"pop_csr_0_{k}", "stream") for k in PROBE_CACHES] + [
        ("pop_csrl_0_16", "ldg"), ("pop_csr_1_0", "stream, aggregated"), ("pop_csr_1_8", "stream, aggregated"),
        ("pop_csrd_0_12", "stream, fixed point"), ("pop_csrd_0_16", "stream, fixed point")]
    for threads, mod in probes.items():
        blocks = (-(-m * 32 // threads),)
        for name, tag in variants:
            fn = mod.get_function(name)
            if name.startswith("pop_csrd"):
                def go(fn=fn, blocks=blocks, threads=threads):
                    acc.fill(0)
                    fn(blocks, (threads,), (a.indptr, a.indices, a.data, f, g, fp, acc, np.float64(scale), flag,
                                            np.int64(m)))
                    gpu.fixed_to_float(acc, bp, scale)
            else:
                def go(fn=fn, blocks=blocks, threads=threads):
                    bp.fill(0)
                    fn(blocks, (threads,), (a.indptr, a.indices, a.data, f, g, fp, bp, np.int64(m)))

            rec("onepass", f"{name} ({tag}) {threads}t", go, lambda: rel(bp, bp64))
    for minb in args.op_minb:  # the CSR one pass compiled with a register cap (MLEM_OP_MINB blocks per SM)
        gpu.OPTIONS = (f"-DMLEM_OP_MINB={minb}",)
        fn = gpu.function("onepass_csr_32")
        log(f"{order}: onepass_csr_32 with MLEM_OP_MINB={minb}: {getattr(fn, 'num_regs', '?')} registers, "
            f"{getattr(fn, 'local_size_bytes', '?')} bytes local")
        for det in (False, True):
            rec("onepass", f"library onepass csr {'fixed' if det else 'atomics'}, MLEM_OP_MINB={minb}",
                lambda det=det: gpu.onepass(a, g, f, bp=bp, fp=fp, deterministic=det, bound=bound, check=False),
                lambda: rel(bp, bp64))
    gpu.OPTIONS = ()
    # compressed A (the lossless format)
    t0 = time.perf_counter()
    host_a = a.to_host()
    cm = CompressedMatrix.from_csr(host_a, "compressed", validate=False)
    del host_a
    ca = gpu.DeviceCompressed.from_host(cm)
    log(f"{order}: compressed A {cm.bytes_per_nnz:.3f} bytes/nnz ({ca.kind}) in {time.perf_counter() - t0:.1f} s")
    del cm
    rec("bp_notrans", "library delta_scatter (compressed, atomics)", lambda: gpu.scatter(ca, c, bp),
        lambda: rel(bp, sc64))
    for det in (False, True):
        rec("onepass", f"library onepass compressed {'fixed' if det else 'atomics'}",
            lambda det=det: gpu.onepass(ca, g, f, bp=bp, fp=fp, deterministic=det, bound=bound, check=False),
            lambda: rel(bp, bp64))
    del ca
    if args.chunked:
        chunked_section(a, f, g, fp, bp, bp64, bound, args, mods, rec, order)
    del a, at
    cp.get_default_memory_pool().free_all_blocks()


def chunked_section(a, f, g, fp, bp, bp64, bound, args, mods, rec, order) -> None:
    """The one pass through a mlemlib.chunked plan (probe kernels pchunk_onepass_f32 / _det), per window."""
    import cupy as cp

    from mlemlib import chunked
    from mlemlib.backends import _compressed_cuda as gpu

    m, n = a.shape
    host = a.to_host()
    for window in args.chunked:
        t0 = time.perf_counter()
        plan = chunked.build_plan(host, window=window)
        log(f"{order}: chunk plan, window {window}: {plan.chunks} chunks, reuse {plan.reuse:.2f}, "
            f"{plan.bytes_per_nnz():.3f} bytes/nnz, built in {time.perf_counter() - t0:.1f} s")
        d = {k: cp.asarray(getattr(plan, k)) for k in ("chunk_rows", "vptr", "voxels", "local")}
        w = window + (window & 1)
        acc = cp.empty(n, dtype=cp.uint64)
        flag = cp.zeros(1, dtype=cp.int32)
        scale = gpu.fixed_scale(bound) / 1024.0  # bound * scale < 2**52: the split 32-bit parts cannot wrap
        for threads in args.chunk_threads:
            mod = mods[threads]
            names = ["pchunk_onepass_f32"] if args.chunk_old else []
            for name in names + list(PCHUNK_VARIANTS):
                fn = mod.get_function(name)
                det = name.startswith("pchunk2")
                shared = 4 * w + (8 if det else 4) * w
                fn.max_dynamic_shared_size_bytes = shared
                head = (d["chunk_rows"], d["vptr"], d["voxels"], a.indptr, d["local"], a.data, f, g, fp)
                if det:
                    def go(fn=fn, threads=threads, shared=shared, head=head):
                        acc.fill(0)
                        fn((plan.chunks,), (threads,), (*head, acc, np.float64(scale), flag, np.int32(w)),
                           shared_mem=shared)
                        gpu.fixed_to_float(acc, bp, scale)
                else:
                    def go(fn=fn, threads=threads, shared=shared, head=head):
                        bp.fill(0)
                        fn((plan.chunks,), (threads,), (*head, bp, np.int32(w)), shared_mem=shared)

                rec("onepass", f"{name} window {window} {threads}t ({getattr(fn, 'num_regs', '?')} regs, "
                    f"reuse {plan.reuse:.1f})", go, lambda: rel(bp, bp64))
                if int(flag.get()[0]):
                    log(f"{order}: {name} fixed point overflow flag {int(flag.get()[0])}")
                    flag.fill(0)
        del d, plan
        cp.get_default_memory_pool().free_all_blocks()
        # the library's kernel on its own layout (rows padded, groups of 128 interleaved for vector loads),
        # with 1..4 groups kept in registers (-DMLEM_CHUNK_CACHE)
        t0 = time.perf_counter()
        dc = gpu.DeviceChunked.upload(a, window=window)
        log(f"{order}: DeviceChunked.upload, window {window}: {dc.chunks} chunks, {dc.nbytes / max(dc.nnz, 1):.3f} "
            f"bytes/nnz, {time.perf_counter() - t0:.1f} s")
        saved = gpu.OPTIONS
        sources = [("csr", dc)]
        for fmt16 in lossy_formats(args):
            from mlemlib.compressed import CompressedMatrix

            t0 = time.perf_counter()
            half = gpu.DeviceChunked.upload(CompressedMatrix.from_csr(host, fmt16, validate=False), window=window)
            log(f"{order}: {fmt16} DeviceChunked.upload: {half.nbytes / max(half.nnz, 1):.3f} bytes/nnz, "
                f"{time.perf_counter() - t0:.1f} s")
            sources.append((fmt16, half))
            del half
        for label, src in sources:
            for groups in args.chunk_groups:
                for extra in args.chunk_options:
                    macros = tuple(f"-DMLEM_CHUNK_{kv}" for kv in extra.split(",") if kv)
                    gpu.OPTIONS = saved + (f"-DMLEM_CHUNK_CACHE={groups}",) + macros
                    fname = src.kernel

                    def lib(src=src):
                        gpu.chunked_onepass(src, g, f, bp=bp, fp=fp, bound=bound, check=False, acc=acc, flag=flag)

                    rec("onepass", f"library {fname} ({label}) window {window}, {groups} groups in registers"
                        f"{', ' + extra if extra else ''}, {gpu.function(fname).num_regs} regs", lib,
                        lambda: rel(bp, bp64))
                    if int(flag.get()[0]):
                        log(f"{order}: library chunked_onepass overflow flag {int(flag.get()[0])}")
                        flag.fill(0)
        del sources
        gpu.OPTIONS = saved
        del dc
        cp.get_default_memory_pool().free_all_blocks()


def lossy_formats(args) -> list[str]:
    """The 16-bit formats whose chunked kernel is timed too (``--chunk-half``: compressed-f16; ``--chunk-values``)."""
    out = ["compressed-f16"] if args.chunk_half else []
    return list(dict.fromkeys(out + [f"compressed-{v}" for v in args.chunk_values]))


def markdown(records: list) -> str:
    lines = ["| order | kind | variant | ms | of one read of A | rel. L2 |", "|---|---|---|---|---|---|"]
    for r in records:
        if "error" in r:
            lines.append(f"| {r['order']} | {r['kind']} | {r['name']} | failed: {r['error'][:60]} | | |")
            continue
        lines.append(f"| {r['order']} | {r['kind']} | {r['name']} | {r['ms']:.3f} | "
                     f"{100 * r['one_read_ms'] / r['ms']:.0f}% | {r['rel_l2']:.1e} |")
    return "\n".join(lines) + "\n"


NCU_TARGET = r'''
import sys, numpy as np
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/tools")
import device_onepass as p, device_kernels as dk
import cupy as cp
from mlemlib.backends import _compressed_cuda as gpu, _cuda_kernels as ck
from mlemlib.compressed import CompressedMatrix
host, _ = dk.trace(int(sys.argv[2]))
a = ck.DeviceCSR.from_host(host)
m, n = a.shape
f = cp.ones(n, dtype=cp.float32); g = ck.spmv(a, f); c = cp.ones(m, dtype=cp.float32)
fp = cp.empty(m, dtype=cp.float32); bp = cp.empty(n, dtype=cp.float32)
ck.scatter(a, c, bp, kernel="scatter", lanes=32)
gpu.onepass(a, g, f, bp=bp, fp=fp)
mod = p.probe_module(256)
blocks = (-(-m * 32 // 256),)
mod.get_function("pscat_csr_0")(blocks, (256,), (a.indptr, a.indices, a.data, c, bp, np.int64(m)))
mod.get_function("pop_csr_0_16")(blocks, (256,), (a.indptr, a.indices, a.data, f, g, fp, bp, np.int64(m)))
acc = cp.zeros(n, dtype=cp.uint64); flag = cp.zeros(1, dtype=cp.int32)
mod.get_function("pop_csrd_0_16")(blocks, (256,), (a.indptr, a.indices, a.data, f, g, fp, acc,
                                  np.float64(gpu.fixed_scale(4 * float(m))), flag, np.int64(m)))
cm = CompressedMatrix.from_csr(host, "compressed", validate=False)
ca = gpu.DeviceCompressed.from_host(cm)
gpu.onepass(ca, g, f, bp=bp, fp=fp)
cp.cuda.Device().synchronize()
'''


def ncu(out: Path, rays: int) -> None:
    import device_kernels as dk

    dk.run_ncu(out / "ncu_onepass.txt", NCU_TARGET, f"{ROOT} {rays}",
               "--kernel-name regex:'scatter_32|onepass_csr_32|conepass_f32c8_32|pscat|pop_' --section SpeedOfLight "
               "--section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section Occupancy "
               "--section WarpStateStats --section LaunchStats",
               r"pscat|pop_|scatter_32|onepass_csr|conepass|Duration|DRAM Throughput|L2 Cache Throughput|"
               r"Achieved Occupancy|Registers Per|Stall|L1/TEX Hit|L2 Hit", timeout=330)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--rays", type=int, default=81)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--orders", default="own,own-reordered")
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--library-only", action="store_true", help="only the library's kernels (no probe variants)")
    ap.add_argument("--chunked", type=lambda t: [int(v) for v in t.split(",")], default=[],
                    help="also the one pass through mlemlib.chunked plans of these windows (probe kernels)")
    ap.add_argument("--chunk-threads", type=lambda t: [int(v) for v in t.split(",")], default=[1024],
                    help="threads per block of the chunked probe kernels (default 1024)")
    ap.add_argument("--chunk-groups", type=lambda t: [int(v) for v in t.split(",")], default=[2],
                    help="groups of 128 elements the library's chunked kernel keeps in registers (compiled variants)")
    ap.add_argument("--chunk-options", type=lambda t: t.split(";"), default=[""],
                    help="compiled variants of the library's chunked kernel, ';'-separated, each comma-separated "
                         "MLEM_CHUNK_ macros without the prefix (e.g. 'STAGE=8;STAGE=8,DYNAMIC=1'; '' the defaults)")
    ap.add_argument("--chunk-half", action="store_true",
                    help="also time the library's chunked kernel on the matrix as compressed-f16 (float16 values)")
    ap.add_argument("--chunk-values", type=lambda t: [v for v in t.split(",") if v], default=[],
                    help="also time the library's chunked kernel on the matrix in these 16-bit formats "
                         "(f16, u16: compressed-f16, compressed-u16)")
    ap.add_argument("--chunk-old", action="store_true",
                    help="also the first chunked kernel (float shared-memory atomics: CAS loops, 20 ms on madpet2)")
    ap.add_argument("--op-minb", type=lambda t: [int(v) for v in t.split(",")], default=[],
                    help="also time the CSR one pass compiled with these MLEM_OP_MINB values")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import cupy as cp

    import device_kernels as dk

    log(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    t0 = time.perf_counter()
    threads = set() if args.library_only else set(THREADS)
    if args.chunked:
        threads |= set(args.chunk_threads)
    mods = {t: probe_module(t) for t in sorted(threads)}
    for t, mod in mods.items():
        for name in ("pop_csr_0_16", "pop_csr_0_20", "pop_csrd_0_16", "pscat_csr_0", "pchunk_onepass_f32",
                     "pchunk2_onepass_8", "pchunk2_onepass_16"):
            fn = mod.get_function(name)
            log(f"{t}t {name}: {getattr(fn, 'num_regs', '?')} registers, {getattr(fn, 'local_size_bytes', '?')} bytes local")
    log(f"probe modules compiled in {time.perf_counter() - t0:.1f} s")
    host, _ = dk.trace(args.rays)
    records: list = []
    for order in args.orders.split(","):
        order_section(host, order, args, mods, records)
        (out / "onepass.json").write_text(json.dumps(records, indent=1))
    md = markdown(records)
    (out / "onepass.md").write_text(md)
    print(md)
    if args.ncu:
        del host
        ncu(out, args.rays)
    return 0


if __name__ == "__main__":
    sys.exit(main())
