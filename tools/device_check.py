#!/usr/bin/env python3
"""Batch check of the CUDA backend on a lent GPU: environment, compiler report, tests, benchmark.

One call does what a device session needs, writing everything under ``--out``
(default ``$OUT``) and printing a short table last::

    PYTHONPATH=. python3 tools/device_check.py --env --sass --tests --bench quick
    PYTHONPATH=. python3 tools/device_check.py --bench full --scanner 16 --ncu

Steps (each optional):

``--env``    nvidia-smi, nvcc, CuPy and driver versions, device facts (NVML).
``--sass``   nvcc -arch=sm_90 --resource-usage of the kernels (registers,
             spills) and cuobjdump SASS counts per kernel (16-byte loads,
             atomics / reductions).
``--tests``  pytest of the GPU tests (tests/test_cuda_*.py, and the gpu tests
             of tests/test_transpose.py when present).
``--bench``  :func:`mlemlib.bench.bench_spmv` on the synthetic tube-of-response
             matrix generated on the GPU: ``quick`` (140x140x10 grid, ~1.8e8
             nnz) or ``full`` (140x140x40, 192 angles x 180 offsets: 1,347,840
             x 784,000, 8.0e8 nnz), with the generation time.
``--scanner RAYS``  also bench the scanner's madpet2 matrix traced on the
             CPUs at RAYS rays per tube (detector-pair order), with its time.
``--ncu``    Nsight Compute sections of the main kernels on the bench matrix.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "mlemlib" / "kernels"
DIMS = {"quick": (140, 140, 10, 192, 180), "full": (140, 140, 40, 192, 180), "tiny": (64, 64, 4, 48, 60)}
SUMMARY: list[str] = []
RESULTS: dict[str, dict] = {}  # bench results by matrix, written to bench.json / bench.md at the end


def sh(cmd: str, out: Path | None = None, timeout: int = 600) -> str:
    """Run a shell command, return (and optionally save) its combined output."""
    t0 = time.perf_counter()
    p = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=timeout, check=False)
    text = f"$ {cmd}\n{p.stdout}{p.stderr}[rc={p.returncode}, {time.perf_counter() - t0:.1f} s]\n"
    if out is not None:
        with open(out, "a", encoding="utf-8") as fh:
            fh.write(text)
    return text


def step_env(out: Path) -> None:
    log = out / "env.txt"  # files back from a device call are few (8): env, sass and ptxas share this one
    for cmd in (
        "nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.max.mem,driver_version --format=csv",
        "nvcc --version | tail -2",
        (
            "python3 -c 'import cupy; print(cupy.__version__); "
            "print(cupy.cuda.runtime.runtimeGetVersion(), cupy.cuda.runtime.driverGetVersion())'"
        ),
        "nproc; free -g | head -2",
    ):
        print(sh(cmd, log), end="")
    from mlemlib.devices import device_facts

    facts = device_facts(0)
    with open(log, "a", encoding="utf-8") as fh:
        fh.write("device facts: " + json.dumps(facts) + "\n")
    SUMMARY.append(f"device: {facts['name']}, theoretical {facts.get('theoretical_bandwidth', 0) / 1e12:.2f} TB/s")


def step_sass(out: Path) -> None:
    log = out / "env.txt"
    cubin = Path("/tmp/spmv.cubin")
    print(sh(f"nvcc -arch=sm_90 -cubin -o {cubin} --resource-usage {KERNELS / 'spmv.cu'}", log)[-3000:])
    sass = sh(f"cuobjdump -sass {cubin}")
    (out / "spmv.sass.txt").write_text(sass)
    # per kernel: count of instruction kinds that matter
    counts: dict[str, dict[str, int]] = {}
    current = None
    for line in sass.splitlines():
        mm = re.match(r"\s*Function : (\S+)", line)
        if mm:
            current = mm.group(1)
            counts[current] = {}
            continue
        if current is None:
            continue
        for key in (
            "LDG.E.128",
            "LDG.E.CONSTANT",
            "LDG.E.128.CONSTANT",
            "RED.E.ADD.F32",
            "REDG",
            "ATOMG",
            "ATOM.E.ADD",
            "ATOMS",
            "RED.E.ADD",
            "LDL",
            "STL",
        ):
            if key in line:
                counts[current][key] = counts[current].get(key, 0) + 1
    lines = [f"{k}: {v}" for k, v in counts.items()]
    with open(log, "a", encoding="utf-8") as fh:
        fh.write("SASS counts per kernel:\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))
    regs = re.findall(
        r"Function properties for (\w+)\n.*?(\d+) bytes spill stores.*?\n.*?Used (\d+) registers",
        sh(f"nvcc -arch=sm_90 -cubin -o {cubin} --resource-usage {KERNELS / 'spmv.cu'}"),
        re.DOTALL,
    )
    spills = [r for r in regs if int(r[1])]
    SUMMARY.append(
        f"ptxas: {len(regs)} kernels, max {max((int(r[2]) for r in regs), default=0)} registers, "
        f"{len(spills)} with spills"
    )


def step_tests(out: Path) -> None:
    files = ["tests/test_cuda_kernels.py", "tests/test_cuda_mlem.py"]
    extra = ""
    if (ROOT / "tests" / "test_transpose.py").exists():
        files.append("tests/test_transpose.py")
        extra = " -m gpu"
    # the gpu marker selects test_transpose's GPU tests; the CUDA test modules are all gpu-marked
    cmd = f"cd {ROOT} && python3 -m pytest -q -p no:cacheprovider -rfEs{extra} {' '.join(files)}"
    text = sh(cmd, out / "pytest.txt", timeout=900)
    print(text[-6000:])
    tail = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed)", ln)]
    SUMMARY.append("pytest: " + (tail[-1].strip() if tail else "no summary line (see pytest.txt)"))


def step_bench(out: Path, which: str, repeat: int, scanner_rays: int | None, ncu: bool) -> None:
    import cupy as cp
    import numpy as np

    from mlemlib.bench import bench_spmv, tor_matrix

    dims = DIMS[which]
    # generation time, measured twice (the first includes compiling synth.cu)
    for i in range(2):
        t0 = time.perf_counter()
        a = tor_matrix(*dims, device=True)
        cp.cuda.Device().synchronize()
        dt = time.perf_counter() - t0
        if i == 0:
            del a
            cp.get_default_memory_pool().free_all_blocks()
    SUMMARY.append(f"TOR {dims} generated on the GPU in {dt:.2f} s: {a.shape[0]} x {a.shape[1]}, {a.nnz} nnz")
    label = f"synthetic TOR {','.join(map(str, dims))} (sinogram order)"
    at = a.transpose()
    a.drop_cusparse()
    res = bench_spmv(a, at, repeat=repeat, warmup=5, secsizes=(2, 5, 8), lanes=(8, 16), matrix_label=label)
    res["generation_s"] = dt
    res["variants"] = step_variants(a, at, repeat)
    RESULTS[f"tor_{which}"] = res
    _summarize(res)
    _write_results(out)
    del at
    if ncu:
        step_ncu(out, dims)
    del a
    cp.get_default_memory_pool().free_all_blocks()
    if scanner_rays:
        from mlemlib.scanner import get_preset
        from mlemlib.scanner.system import trace_rows

        cfg = get_preset("madpet2", rays=scanner_rays)
        t0 = time.perf_counter()
        host = trace_rows(cfg, np.arange(cfg.n_lors, dtype=np.int64))
        dt = time.perf_counter() - t0
        SUMMARY.append(
            f"madpet2 rays={scanner_rays} traced on {os.cpu_count()} CPUs in {dt:.1f} s: "
            f"{host.shape[0]} x {host.shape[1]}, {host.nnz} nnz"
        )
        from mlemlib.backends import _cuda_kernels as ck

        a = ck.DeviceCSR.from_host(host)
        del host
        at = a.transpose()
        a.drop_cusparse()
        res = bench_spmv(
            a,
            at,
            repeat=repeat,
            warmup=5,
            secsizes=(5,),
            iterations=(
                ("cusparse", "cusparse"),
                ("csr_vector", "csr_vector"),
                ("csr_vector", "scatter"),
                ("csr_vector", "scatter_smem"),
            ),
            matrix_label=f"scanner madpet2, rays={scanner_rays} (detector-pair order)",
        )
        res["generation_s"] = dt
        res["variants"] = step_variants(a, at, repeat, registers=False)
        RESULTS["madpet2"] = res
        _summarize(res)
        _write_results(out)


def step_scanner_iterations(out: Path, rays: int, repeat: int) -> None:
    """Whole MLEM iterations on the madpet2 matrix, the no-transpose choices among them."""
    import numpy as np

    from mlemlib.backends import _cuda_kernels as ck
    from mlemlib.bench import bench_spmv
    from mlemlib.scanner import get_preset
    from mlemlib.scanner.system import trace_rows

    cfg = get_preset("madpet2", rays=rays)
    t0 = time.perf_counter()
    host = trace_rows(cfg, np.arange(cfg.n_lors, dtype=np.int64))
    dt = time.perf_counter() - t0
    SUMMARY.append(
        f"madpet2 rays={rays} traced on {os.cpu_count()} CPUs in {dt:.1f} s (with JIT): "
        f"{host.shape[0]} x {host.shape[1]}, {host.nnz} nnz"
    )
    a = ck.DeviceCSR.from_host(host)
    del host
    at = a.transpose()
    a.drop_cusparse()
    res = bench_spmv(
        a,
        at,
        repeat=repeat,
        warmup=5,
        fp_kernels=(),
        bp_kernels=(),
        notrans_kernels=(),
        iterations=(("csr_vector", "notrans"), ("csr_vector", "scatter_vec"), ("csr_vector", "csr_vector")),
        check=False,
        matrix_label=f"scanner madpet2, rays={rays} (detector-pair order), iterations",
    )
    res["generation_s"] = dt
    RESULTS["madpet2_iterations"] = res
    _summarize(res)
    _write_results(out)


def _write_results(out: Path) -> None:
    from mlemlib.bench import format_markdown

    (out / "bench.json").write_text(json.dumps(RESULTS, indent=2, default=str))
    (out / "bench.md").write_text("\n\n".join(format_markdown(r) for r in RESULTS.values()) + "\n")


def step_variants(a, at, repeat: int, registers: bool = True) -> list[dict]:
    """Time the main kernels built with and without a 32-register cap (-DMLEM_MIN_BLOCKS=8)."""
    import cupy as cp
    import numpy as np

    from mlemlib.backends import _cuda_kernels as ck
    from mlemlib.backends import _cuda_plan as plan
    from mlemlib.bench import copy_bandwidth, time_gpu

    m, n = a.shape
    bw = copy_bandwidth()["bandwidth"]
    rng = np.random.default_rng()
    x = cp.asarray(rng.uniform(0.5, 1.5, n).astype(np.float32))
    c = cp.asarray(rng.uniform(0.5, 1.5, m).astype(np.float32))
    ym, yn = cp.empty(m, cp.float32), cp.empty(n, cp.float32)
    cases = {
        "fp csr_vector": (lambda: ck.spmv(a, x, ym), plan.spmv_bytes(m, n, a.nnz)),
        "bp csr_vector": (lambda: ck.spmv(at, c, yn), plan.spmv_bytes(n, m, a.nnz)),
        "bp scatter": (lambda: ck.scatter(a, c, yn, kernel="scatter"), plan.spmv_bytes(m, n, a.nnz)),
        "bp scatter_vec": (lambda: ck.scatter(a, c, yn, kernel="scatter_vec"), plan.spmv_bytes(m, n, a.nnz)),
    }
    rows = []
    for opts in ((), ("-DMLEM_MIN_BLOCKS=8",)) if registers else ((),):
        ck.SPMV_OPTIONS = opts
        for name, (fn, nbytes) in cases.items():
            t = float(np.median(time_gpu(fn, repeat=repeat, warmup=3)))
            rows.append(
                {"options": " ".join(opts) or "default", "case": name, "median_s": t, "of_copy": nbytes / t / bw}
            )
            SUMMARY.append(f"variant {rows[-1]['options']:<20} {name:<16} {t * 1e3:8.3f} ms {nbytes / t / bw:6.1%}")
    ck.SPMV_OPTIONS = ()
    # scatter_smem: rows per block (nnz per chunk) against the window's flush and the tail
    nbytes = plan.spmv_bytes(m, n, a.nnz)
    for k in (16, 17, 18, 19, 20):
        sp = ck.smem_plan(a, chunk_nnz=1 << k)
        t = float(
            np.median(
                time_gpu(lambda sp=sp: ck.scatter(a, c, yn, kernel="scatter_smem", smem=sp), repeat=repeat, warmup=3)
            )
        )
        name = f"scatter_smem 2^{k}"
        rows.append(
            {
                "options": f"chunk_nnz=2^{k}",
                "case": "bp scatter_smem",
                "median_s": t,
                "of_copy": nbytes / t / bw,
                "local_fraction": sp.local_fraction,
                "chunks": len(sp.chunk_rows) - 1,
            }
        )
        SUMMARY.append(f"variant {name:<20} local {sp.local_fraction:5.1%} {t * 1e3:8.3f} ms {nbytes / t / bw:6.1%}")
    return rows


def _summarize(res: dict) -> None:
    mtx = res["matrix"]
    SUMMARY.append(
        f"-- {mtx['label']}: {mtx['shape'][0]}x{mtx['shape'][1]}, {mtx['nnz']} nnz; "
        f"copy {res['copy']['bandwidth'] / 1e12:.3f} TB/s"
    )
    for r in res["kernels"]:
        lab = (
            r["kernel"]
            + (f"/s{r['secsize']}" if r.get("secsize") else "")
            + (f"/L{r['lanes']}" if r.get("lanes") and r["kernel"] == "csr_vector" else "")
        )
        SUMMARY.append(
            f"{r['op']:<10} {lab:<18} {r['median_s'] * 1e3:8.3f} ms {r['of_copy']:6.1%} "
            f"x{(r.get('vs_cusparse') or 0):5.2f} err {r.get('rel_l2', float('nan')):.1e} "
            f"bound {r.get('worst_of_bound', float('nan')):.2f}"
        )
    for r in res["iterations"]:
        SUMMARY.append(
            f"iter {r['fp']}+{r['bp']} ({r.get('bp_requested', r['bp'])}): {r['median_s'] * 1e3:.3f} ms, floor {r['floor_s'] * 1e3:.3f} ms, "
            f"{r['of_floor']:.1%}"
        )


NCU_TARGET = r"""
import sys, cupy as cp, numpy as np
from mlemlib.bench import tor_matrix
from mlemlib.backends import _cuda_kernels as ck
dims = tuple(int(v) for v in sys.argv[1].split(","))
a = tor_matrix(*dims, device=True); t = a.transpose(); a.drop_cusparse()
x = cp.asarray(np.random.default_rng().uniform(0.5, 1.5, a.shape[1]).astype(np.float32))
c = cp.asarray(np.random.default_rng().uniform(0.5, 1.5, a.shape[0]).astype(np.float32))
sp = ck.smem_plan(a)
for _ in range(2):
    ck.spmv(a, x, kernel="csr_vector"); ck.spmv(t, c, kernel="csr_vector")
    ck.scatter(a, c, kernel="scatter"); ck.scatter(a, c, kernel="scatter_vec")
    ck.scatter(a, c, kernel="scatter_smem", smem=sp); ck.spmv(a, x, kernel="merge", secsize=5)
cp.cuda.Device().synchronize()
"""


def step_ncu(out: Path, dims) -> None:
    if not shutil.which("ncu"):
        SUMMARY.append("ncu: not found")
        return
    target = Path("/tmp/ncu_target.py")
    target.write_text(NCU_TARGET)
    cmd = (
        f"cd {ROOT} && PYTHONPATH={ROOT} ncu --kernel-name regex:'csr_vector|scatter|merge_spmv' "
        f"--launch-skip 6 --launch-count 6 --section SpeedOfLight --section MemoryWorkloadAnalysis "
        f"--section Occupancy python3 {target} {','.join(map(str, dims))}"
    )
    text = sh(cmd, out / "ncu.txt", timeout=400)
    keep = [
        ln
        for ln in text.splitlines()
        if re.search(
            r"^\s{2}\S.*\(\d+, \d+, \d+\)x|DRAM Throughput|Memory "
            r"Throughput|Duration|L2 Hit|Achieved Occupancy|rc=",
            ln,
        )
    ]
    print("\n".join(keep))
    SUMMARY.append(f"ncu: {len(keep)} lines kept in ncu.txt")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "device_out"))
    ap.add_argument("--env", action="store_true")
    ap.add_argument("--sass", action="store_true")
    ap.add_argument("--tests", action="store_true")
    ap.add_argument("--bench", choices=sorted(DIMS), default=None)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--scanner", type=int, default=None, metavar="RAYS")
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument(
        "--scanner-iterations",
        type=int,
        default=None,
        metavar="RAYS",
        help="only whole iterations (bp notrans...) on the madpet2 matrix at RAYS rays",
    )
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(name)s: %(message)s",
        handlers=[logging.FileHandler(out / "log.txt"), logging.StreamHandler(sys.stderr)],
    )
    t0 = time.perf_counter()
    steps = [
        ("env", args.env, lambda: step_env(out)),
        ("sass", args.sass, lambda: step_sass(out)),
        ("tests", args.tests, lambda: step_tests(out)),
        ("bench", args.bench is not None, lambda: step_bench(out, args.bench, args.repeat, args.scanner, args.ncu)),
        (
            "scanner-iterations",
            args.scanner_iterations is not None,
            lambda: step_scanner_iterations(out, args.scanner_iterations, args.repeat),
        ),
    ]
    for name, on, fn in steps:
        if not on:
            continue
        t = time.perf_counter()
        try:
            fn()
        except Exception as exc:
            logging.getLogger("device_check").exception("step %s failed", name)
            SUMMARY.append(f"step {name} FAILED: {type(exc).__name__}: {exc}")
        SUMMARY.append(f"[{name}: {time.perf_counter() - t:.1f} s]")
    SUMMARY.append(f"[total {time.perf_counter() - t0:.1f} s]")
    (out / "summary.txt").write_text("\n".join(SUMMARY) + "\n")
    print("\n==== summary ====")
    print("\n".join(SUMMARY))
    return 0


if __name__ == "__main__":
    sys.exit(main())
