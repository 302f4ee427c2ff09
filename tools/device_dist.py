#!/usr/bin/env python3
"""Device batch of the multi-GPU work: leases, correctness, multi-process, scaling (run on nvidia-h200-x4).

One call does everything, writing under ``--out`` (default ``$OUT``) and
printing a short table last::

    NCCL_NVLS_ENABLE=0 PYTHONPATH=. python3 tools/device_dist.py --all

Sections (each also alone: ``--section NAME``; the heavy ones run as child
processes with their own time limits, so a hang in one loses only it):

``env``      nvidia-smi (GPUs, PCI bus ids, NVLink topology), CuPy, NCCL.
``lease``    two concurrent ``mlem lease -g 2`` jobs on 4 GPUs (as two
             Snakemake jobs under ``--resources gpu=4``) report the devices
             they got (CUDA_VISIBLE_DEVICES, PCI bus ids); a third asking
             for 2 more times out with the holders named.
``small``    correctness through the files of the workflow: a small TOR
             matrix written as matrix.h5 / transpose.h5, ``partition_file``
             for 1, 2, 4 parts, ``NcclBackend`` reading its row ranges
             (``read_rows``) and part files, both layouts, graph off and on,
             against the one-GPU ``CudaBackend`` image; run-to-run
             determinism; then one process per GPU (``launch_local``, file
             bootstrap; MPI if ``mpirun`` exists) with 2 and 4 ranks.
``bench``    the scaling benchmark on the TOR matrix of Matrix-2's voxel
             grid generated on the GPU: 1, 2, 4 GPUs x layouts x graph,
             per-step times, iteration (synchronised and back-to-back),
             speed-up, efficiency, bytes per GPU; all-reduce alone; image
             agreement with one GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on lent machines (KINDS.md)

SMALL_DIMS = (64, 64, 8, 64, 80)  # 35,840 x 32,768
BIG_DIMS = (140, 140, 40, 192, 180)  # 1,347,840 x 784,000, ~8.0e8 nnz (Matrix-2 voxel grid)
ITERS_CHECK = 20


def out_dir(args) -> Path:
    p = Path(args.out or os.environ.get("OUT") or "device-out")
    p.mkdir(parents=True, exist_ok=True)
    return p


def save(out: Path, name: str, data: dict) -> None:
    (out / name).write_text(json.dumps(data, indent=1, default=str))


def sh(cmd: str, timeout: int = 120) -> str:
    p = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=timeout, check=False)
    return f"$ {cmd}\n{p.stdout}{p.stderr}[rc={p.returncode}]\n"


# --------------------------------------------------------------------------- env
def section_env(args, out: Path) -> None:
    text = ""
    for cmd in (
        "nvidia-smi --query-gpu=index,name,pci.bus_id,uuid,memory.total,driver_version --format=csv",
        "nvidia-smi topo -m",
        "python3 -c 'import cupy; from cupy.cuda import nccl; print(\"cupy\", cupy.__version__, \"nccl\", nccl.get_version())'",
        "which mpirun mpiexec srun; python3 -c 'from mpi4py import MPI; print(MPI.Get_library_version())' 2>&1 | tail -1",
        "python3 -c 'import pynvml; print(\"nvml ok\")' 2>&1 | tail -1",
        "nproc; env | grep -E '^(NCCL|CUDA)_' ",
    ):
        text += sh(cmd)
    (out / "env.txt").write_text(text)
    print(text)


# --------------------------------------------------------------------------- lease
REPORT = (
    "import os, socket, time, cupy as cp\n"
    "n = cp.cuda.runtime.getDeviceCount()\n"
    "bus = [cp.cuda.runtime.deviceGetPCIBusId(i) for i in range(n)]\n"
    "print(f'job {os.environ[\"JOB\"]} pid {os.getpid()} t={time.time():.2f} CUDA_VISIBLE_DEVICES={os.environ.get(\"CUDA_VISIBLE_DEVICES\")} "
    "sees {n} GPU(s), PCI {bus}', flush=True)\n"
    "x = [cp.ones(1 << 20) for i in range(n)]\n"
    "time.sleep(6)\n"
    "print(f'job {os.environ[\"JOB\"]} done t={time.time():.2f}', flush=True)\n"
)


def section_lease(args, out: Path) -> None:
    lock = Path("/tmp/mlem-gpu-locks-demo")
    env = dict(os.environ, MLEM_LOCK_DIR=str(lock), PYTHONPATH=str(ROOT))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [sys.executable, "-m", "mlemlib", "-v", "lease", "-g", "2", "-t", "30", "--", sys.executable, "-c", REPORT]
    procs = [subprocess.Popen(cmd, env=dict(env, JOB=j), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for j in "AB"]
    from mlemlib.dist.lease import status as lease_status

    t0 = time.monotonic()
    while time.monotonic() - t0 < 30 and sum(r["held"] for r in lease_status(lock, env)) < 4:
        time.sleep(0.2)
    status = subprocess.run([sys.executable, "-m", "mlemlib", "lease", "--status"], env=env, capture_output=True, text=True)
    third = subprocess.run(
        [sys.executable, "-m", "mlemlib", "lease", "-g", "2", "-t", "1", "--", "true"], env=dict(env, JOB="C"), capture_output=True, text=True
    )
    logs = [p.communicate(timeout=60)[0] for p in procs]
    text = "".join(logs) + "--- mlem lease --status while A and B run:\n" + status.stdout + status.stderr
    text += f"--- job C asks for 2 more (timeout 1 s): rc={third.returncode}\n{third.stderr}"
    (out / "lease.txt").write_text(text)
    print(text)


# --------------------------------------------------------------------------- helpers on the GPU
def sync_all(cp, devices) -> None:
    for d in devices:
        with cp.cuda.Device(d):
            cp.cuda.runtime.deviceSynchronize()


def run_image(be, iters: int):
    f = be.initial_image()
    for _ in range(iters):
        f = be.iterate(f)
    return be.to_host(f)


def rel_l2(a, b) -> float:
    import numpy as np

    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    nb = float(np.linalg.norm(b))
    return float(np.linalg.norm(a - b)) / nb if nb else float(np.linalg.norm(a))


def free_pools(cp, devices) -> None:
    import gc

    gc.collect()
    for d in devices:
        with cp.cuda.Device(d):
            cp.get_default_memory_pool().free_all_blocks()


def parse_matrix(spec) -> tuple | str:
    """``tor`` (Matrix-2's voxel grid, :data:`BIG_DIMS`), ``madpet2[:RAYS]`` (the scanner preset) or a dims tuple."""
    if isinstance(spec, tuple):
        return spec
    if spec in (None, "tor"):
        return BIG_DIMS
    if not str(spec).startswith("madpet2"):
        raise SystemExit(f"--matrix must be tor or madpet2[:RAYS], got {spec!r}")
    return str(spec)


def make_problem(dims, *, host: bool):
    """The matrix on GPU 0 (TOR generated there, or the scanner preset traced on the CPUs), A^T, measurement, norm."""
    import cupy as cp
    import numpy as np

    from mlemlib.backends import _cuda_kernels as ck
    from mlemlib.bench import tor_matrix

    t0 = time.perf_counter()
    with cp.cuda.Device(0):
        if isinstance(dims, str):  # madpet2[:RAYS]: the scanner's own matrix, detector-pair order
            from mlemlib.scanner import get_preset
            from mlemlib.scanner.system import trace_rows

            rays = int(dims.split(":")[1]) if ":" in dims else None
            cfg = get_preset("madpet2", rays=rays)
            host_a = trace_rows(cfg, np.arange(cfg.n_lors, dtype=np.int64))
            print(f"traced {dims} ({cfg.rays} rays) on {os.cpu_count()} CPUs in {time.perf_counter() - t0:.1f} s", flush=True)
            a = ck.DeviceCSR.from_host(host_a)
            del host_a
        else:
            a = tor_matrix(*dims, device=True)
        at = a.transpose()
        a.drop_cusparse()
        m, n = a.shape
        rng = np.random.default_rng(7)
        x = cp.asarray(rng.uniform(0.5, 1.5, n).astype(np.float32))
        y = ck.spmv(a, x, kernel="csr_vector")
        g = cp.rint(y * np.float32(10.0)).get()
        norm = cp.bincount(a.indices, weights=a.data.astype(cp.float64), minlength=n).get()
        cp.cuda.runtime.deviceSynchronize()
    secs = time.perf_counter() - t0
    if host:
        return a.to_host(), at.to_host(), g, norm, secs
    return a, at, g, norm, secs


# --------------------------------------------------------------------------- parts: one GPU's share, on one GPU
def section_parts(args, out: Path) -> None:
    """Kernel times of each GPU's share of the work for P = 1, 2, 4, run one part at a time on GPU 0.

    Separates what a quarter of the matrix costs a kernel (short rows of
    A_k^T, tails) from what several GPUs cost (NCCL, skew): forward
    projection with the fused correlation on A_k, back projection on A_k^T
    (local layout) and on the row block of A^T (thesis layout), each with 8,
    16 and 32 lanes per row (``--waves`` caps the grid). CUDA events,
    medians of 20 calls.
    """
    import cupy as cp
    import numpy as np

    from mlemlib.backends import _cuda_kernels as ck
    from mlemlib.backends import _cuda_plan as plan
    from mlemlib.bench import copy_bandwidth, time_gpu
    from mlemlib.backends._cuda_kernels import rows_to_device, unpadded
    from mlemlib.backends.nccl import build_plan

    reps = 20
    spec = parse_matrix(args.matrix)
    a, at, g, norm, gen_s = make_problem(spec, host=False)
    m, n = a.shape
    res: dict = {"matrix": str(spec), "shape": [m, n], "nnz": a.nnz, "rows": []}
    res["copy_bandwidth"] = copy_bandwidth()["bandwidth"]
    rng = np.random.default_rng(3)
    x = cp.asarray(rng.uniform(0.5, 1.5, n).astype(np.float32))
    gd = cp.asarray(g, dtype=cp.float32)
    lanes_fp = plan.choose_lanes(a.nnz / m)
    lanes_bp = plan.choose_lanes(a.nnz / n)
    c_full = ck.spmv(a, x, kernel="csr_vector", lanes=lanes_fp, mode=ck.MODE_CORR, aux0=gd)
    bw = res["copy_bandwidth"]

    def rec(p, k, what, mat, lanes, waves, fn):
        t = float(np.median(time_gpu(fn, repeat=reps, warmup=3)))
        by = plan.spmv_bytes(mat.shape[0], mat.shape[1], mat.nnz)
        r = {"parts": p, "part": k, "what": what, "rows": mat.shape[0], "cols": mat.shape[1], "nnz": mat.nnz,
             "lanes": lanes, "waves": waves, "ms": t * 1e3, "tbps": by / t / 1e12, "of_copy": by / t / bw}
        res["rows"].append(r)
        print(f"P={p} k={k} {what:12} lanes {lanes:2} waves {waves!s:4} {mat.shape[0]:>9} x {mat.shape[1]:<9} {mat.nnz:>11} nnz "
              f"{t * 1e3:8.3f} ms {by / t / 1e12:5.2f} TB/s {100 * by / t / bw:5.1f}%", flush=True)

    bp = cp.empty(n, dtype=cp.float32)
    for lanes in (8, 16, 32):
        rec(1, 0, "fp", a, lanes, None, lambda: ck.spmv(a, x, c_full, lanes=lanes, mode=ck.MODE_CORR, aux0=gd))
        rec(1, 0, "bp", at, lanes, None, lambda: ck.spmv(at, c_full, bp, lanes=lanes))
    c_full = ck.spmv(a, x, c_full, lanes=lanes_fp, mode=ck.MODE_CORR, aux0=gd)
    save(out, f"parts-{args.matrix}.json", res)
    for p in (2, 4):
        pl = build_plan(a, at, p, None, "thesis")
        for k in range(p):
            r0, r1 = (int(v) for v in pl["rows"][k])
            c0, c1 = (int(v) for v in pl["transpose_rows"][k])
            a_k = rows_to_device(a, r0, r1, 0, align=True)
            plain = unpadded(a_k)
            at_k = plain.transpose()
            plain.drop_cusparse()
            del plain
            atb = rows_to_device(at, c0, c1, 0, align=True)
            g_k = gd[r0:r1]
            c_k = cp.empty(r1 - r0, dtype=cp.float32)
            for lanes in (8, 16, 32):
                rec(p, k, "fp", a_k, lanes, None, lambda: ck.spmv(a_k, x, c_k, lanes=lanes, mode=ck.MODE_CORR, aux0=g_k))
            c_k = ck.spmv(a_k, x, c_k, lanes=lanes_fp, mode=ck.MODE_CORR, aux0=g_k)
            for lanes in (8, 16, 32):
                rec(p, k, "bp_local", at_k, lanes, None, lambda: ck.spmv(at_k, c_k, bp, lanes=lanes))
            ob = bp[c0:c1]
            for lanes in (8, 16, 32):
                rec(p, k, "bp_thesis", atb, lanes, None, lambda: ck.spmv(atb, c_full, ob, lanes=lanes))
            del a_k, at_k, atb
            free_pools(cp, [0])
            save(out, f"parts-{args.matrix}.json", res)
    print("SECTION DONE", flush=True)


# --------------------------------------------------------------------------- small: correctness through files
def section_small(args, out: Path) -> None:
    import cupy as cp
    import numpy as np

    from mlemlib.backends.cuda import CudaBackend
    from mlemlib.dist.mpi import launch_local
    from mlemlib.backends.nccl import NcclBackend
    from mlemlib.formats.h5 import MatrixH5, write_matrix_h5
    from mlemlib.partition import partition_file

    import faulthandler

    faulthandler.dump_traceback_later(75, repeat=True)  # a hang shows its stack in the log
    t_start = time.perf_counter()
    res: dict = {"dims": SMALL_DIMS, "iterations": ITERS_CHECK, "runs": [], "mpi": []}
    work = Path("/tmp/mlem-dist-small")
    work.mkdir(parents=True, exist_ok=True)
    a, at, g, norm, gen_s = make_problem(SMALL_DIMS, host=True)
    res.update(shape=list(a.shape), nnz=a.nnz)
    write_matrix_h5(work / "matrix.h5", a, source="tor")
    write_matrix_h5(work / "transpose.h5", at, source="tor^T")
    np.save(work / "g.npy", g)
    np.save(work / "norm.npy", norm)
    ndev = cp.cuda.runtime.getDeviceCount()
    counts = [p for p in (1, 2, 4) if p <= ndev]
    for p in counts:
        partition_file(work / "matrix.h5", work / "transpose.h5", p, work / f"parts-{p}")
    print(f"[{time.perf_counter() - t_start:.0f} s] files and plans written", flush=True)
    one = CudaBackend(a, g, norm, transpose=at, fp="csr_vector", bp="csr_vector")
    ref = run_image(one, ITERS_CHECK)
    np.save(work / "ref.npy", ref)
    res["reference_sum"] = float(ref.sum(dtype=np.float64))
    del one
    mat = MatrixH5(work / "matrix.h5")
    tr = MatrixH5(work / "transpose.h5")
    for p in counts:
        for layout in ("local", "thesis"):
            try:
                t0 = time.perf_counter()
                be = NcclBackend(mat, g, norm, transpose=tr, gpus=p, layout=layout, plan=work / f"parts-{p}")
                img1 = run_image(be, ITERS_CHECK)
                img2 = run_image(be, ITERS_CHECK)
                be.use_graph(True)
                img3 = run_image(be, ITERS_CHECK)
                np.save(work / f"img-{layout}-{p}.npy", img1)
                rec = {
                    "gpus": p,
                    "layout": layout,
                    "rel_l2_vs_1gpu": rel_l2(img1, ref),
                    "bitwise_vs_1gpu": bool(np.array_equal(img1, ref)),
                    "repeat_bitwise": bool(np.array_equal(img1, img2)),
                    "graph_bitwise_vs_eager": bool(np.array_equal(img1, img3)),
                    "finite": bool(np.isfinite(img1).all()),
                    "nnz_per_gpu": [s.nnz for s in be.shards],
                    "seconds": time.perf_counter() - t0,
                }
                print(json.dumps(rec), flush=True)
                t1 = time.perf_counter()
                be.close()
                rec["close_s"] = time.perf_counter() - t1
                del be
            except Exception as exc:  # keep going: one failing configuration must not hide the rest
                rec = {"gpus": p, "layout": layout, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
            res["runs"].append(rec)
            print(json.dumps({k: v for k, v in rec.items() if k != "trace"}), flush=True)
            free_pools(cp, range(ndev))
            save(out, "small.json", res)
    # one process per GPU (file bootstrap): the same images?
    for p, layout in ((2, "local"), (2, "thesis"), (4, "local"), (4, "thesis")):
        if p > ndev:
            continue
        t0 = time.perf_counter()
        dst = work / f"mpi-{layout}-{p}.npy"
        dst.unlink(missing_ok=True)
        codes = launch_local(
            p,
            [sys.executable, str(Path(__file__).resolve()), "--section", "rank", "--work", str(work), "--layout", layout, "--parts", str(p)],
            timeout=90,
        )
        rec = {"ranks": p, "layout": layout, "exit_codes": codes, "seconds": time.perf_counter() - t0}
        if dst.exists():
            img = np.load(dst)
            same = np.load(work / f"img-{layout}-{p}.npy") if (work / f"img-{layout}-{p}.npy").exists() else None
            rec.update(
                rel_l2_vs_1gpu=rel_l2(img, ref),
                bitwise_vs_1gpu=bool(np.array_equal(img, ref)),
                bitwise_vs_one_process=bool(same is not None and np.array_equal(img, same)),
                rel_l2_vs_one_process=rel_l2(img, same) if same is not None else None,
            )
        res["mpi"].append(rec)
        print(json.dumps(rec), flush=True)
        save(out, "small.json", res)
    if subprocess.run("which mpirun", shell=True, capture_output=True).returncode == 0:
        cmd = (
            f"mpirun --allow-run-as-root -n 2 -x NCCL_NVLS_ENABLE=0 -x PYTHONPATH {sys.executable} {Path(__file__).resolve()} "
            f"--section rank --work {work} --layout local --parts 2 --bootstrap mpi"
        )
        dst = work / "mpi-local-2.npy"
        dst.unlink(missing_ok=True)
        t0 = time.perf_counter()
        res["mpirun"] = {"log": sh(cmd, timeout=90)[-3000:], "seconds": time.perf_counter() - t0}
        if dst.exists():
            img = np.load(dst)
            res["mpirun"].update(
                rel_l2_vs_1gpu=rel_l2(img, ref),
                bitwise_vs_one_process=bool(np.array_equal(img, np.load(work / "img-local-2.npy"))),
            )
        print(json.dumps({k: v for k, v in res["mpirun"].items() if k != "log"}), flush=True)
        save(out, "small.json", res)
    print(f"[{time.perf_counter() - t_start:.0f} s] SECTION DONE", flush=True)


def section_rank(args, out: Path) -> None:
    """One rank of the multi-process check (started by launch_local or mpirun)."""
    import numpy as np

    from mlemlib.backends import make_backend
    from mlemlib.formats.h5 import MatrixH5

    import faulthandler

    faulthandler.dump_traceback_later(60, repeat=True)
    work = Path(args.work)
    g = np.load(work / "g.npy")
    norm = np.load(work / "norm.npy")
    be = make_backend(
        MatrixH5(work / "matrix.h5"), g, norm, transpose=MatrixH5(work / "transpose.h5"), gpus=args.parts,
        layout=args.layout, plan=work / f"parts-{args.parts}", launcher=args.bootstrap,
    )
    img = run_image(be, ITERS_CHECK)
    shard = be.shards[0]
    print(f"rank part {shard.part} on GPU {shard.device} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}) "
          f"rows {shard.rows} nnz {shard.nnz} image sum {img.sum(dtype=np.float64):.9g}", flush=True)
    if be.writes_output:
        tmp = work / f".mpi-{args.layout}-{args.parts}.npy"
        np.save(tmp, img)
        os.replace(tmp, work / f"mpi-{args.layout}-{args.parts}.npy")
    be.close()
    print(f"rank part {shard.part}: closed", flush=True)


# --------------------------------------------------------------------------- bench: scaling
def time_backend(be, cp, devices, *, iters: int, synced: bool):
    """Per-step medians (synced: last_step_times each iteration) and wall seconds per iteration."""
    import numpy as np

    f = be.initial_image()
    for _ in range(3):
        f = be.iterate(f)
    sync_all(cp, devices)
    steps: dict[str, list[float]] = {}
    walls = []
    t0 = time.perf_counter()
    for _ in range(iters):
        t1 = time.perf_counter()
        f = be.iterate(f)
        if synced:
            for k, v in be.last_step_times().items():
                steps.setdefault(k, []).append(v)
            walls.append(time.perf_counter() - t1)
    sync_all(cp, devices)
    total = (time.perf_counter() - t0) / iters
    out = {k: float(np.median(v)) for k, v in steps.items()}
    if synced:
        out["wall_synced"] = float(np.median(walls))
    else:
        out["wall_pipelined"] = total
    return out


def allreduce_micro(cp, comms, devices, length: int, reps: int = 30) -> float:
    import numpy as np
    from cupy.cuda import nccl

    bufs, streams = [], []
    for d in devices:
        with cp.cuda.Device(d):
            bufs.append(cp.ones(length, dtype=cp.float32))
            streams.append(cp.cuda.Stream(non_blocking=True))
    ts = []
    for r in range(reps + 5):
        sync_all(cp, devices)
        t0 = time.perf_counter()
        nccl.groupStart()
        for c, b, s, d in zip(comms, bufs, streams, devices):
            with cp.cuda.Device(d):
                c.allReduce(b.data.ptr, b.data.ptr, length, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, s.ptr)
        nccl.groupEnd()
        for s in streams:
            s.synchronize()
        if r >= 5:
            ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def bench_name(args) -> str:
    """bench.json for the TOR matrix (as before), bench-madpet2[-RAYS].json for the scanner's, plus -wN for a grid cap."""
    tag = "" if args.matrix in (None, "tor") else "-" + str(args.matrix).replace(":", "-")
    if args.waves is not None:
        tag += f"-w{args.waves}"
    return f"bench{tag}.json"


def _waves():
    from mlemlib.backends import _cuda_plan as plan

    return plan.WAVES


def section_bench(args, out: Path) -> None:
    import cupy as cp
    import numpy as np
    from cupy.cuda import nccl

    from mlemlib.backends.cuda import CudaBackend
    from mlemlib.bench import copy_bandwidth
    from mlemlib.backends.nccl import NcclBackend

    t_start = time.perf_counter()
    dims = tuple(args.dims) if args.dims else parse_matrix(args.matrix)
    ndev = cp.cuda.runtime.getDeviceCount()
    res: dict = {"dims": dims, "devices": ndev, "runs": [], "allreduce": [], "waves": _waves()}
    with cp.cuda.Device(0):
        res["copy_bandwidth"] = copy_bandwidth()["bandwidth"]
    a, at, g, norm, gen_s = make_problem(dims, host=False)
    m, n = a.shape
    res.update(shape=[m, n], nnz=a.nnz, generate_s=gen_s)
    print(f"matrix {m} x {n}, {a.nnz} nnz, generated + transposed on GPU 0 in {gen_s:.1f} s", flush=True)
    save(out, bench_name(args), res)

    # one GPU, the CudaBackend: the baseline and the reference image
    one = CudaBackend(a, g, norm, transpose=at, fp="csr_vector", bp="csr_vector")
    ref = run_image(one, 10)
    base = time_backend(one, cp, [0], iters=30, synced=True)
    base.update(time_backend(one, cp, [0], iters=50, synced=False))
    res["one_gpu"] = {"backend": "cuda", "lanes": {"fp": one._lanes(one.a), "bp": one._lanes(one.at)}, **base}
    print("1 GPU CudaBackend:", json.dumps(base), flush=True)
    del one
    free_pools(cp, [0])
    save(out, bench_name(args), res)

    comms_by_p = {}
    for p in [q for q in (1, 2, 4) if q <= ndev]:
        devices = list(range(p))
        comms_by_p[p] = nccl.NcclCommunicator.initAll(devices)
        if p > 1:
            for length, what in ((n, "n (image)"), (m, "m (projection)")):
                t = allreduce_micro(cp, comms_by_p[p], devices, length)
                res["allreduce"].append({"gpus": p, "vector": what, "length": length, "median_s": t})
                print(f"allreduce {p} GPUs {what} {length}: {t * 1e6:.1f} us", flush=True)
        for layout in ("local", "thesis"):
            rec: dict = {"gpus": p, "layout": layout}
            try:
                t0 = time.perf_counter()
                be = NcclBackend(a, g, norm, transpose=at, gpus=p, layout=layout, comms=comms_by_p[p])
                rec["setup_s"] = time.perf_counter() - t0
                rec["nnz_per_gpu"] = [s.nnz for s in be.shards]
                rec["lanes"] = {"fp": be.lanes_fp, "bp": sorted({be.lanes_bp(s) for s in be.shards})}
                print(f"{p} GPU {layout}: lanes {rec['lanes']}", flush=True)
                bytes_gpu = []
                for s in be.shards:
                    bt = s.a.nbytes + (s.at.nbytes if s.at is not None else 0)
                    bytes_gpu.append(bt)
                rec["bytes_per_gpu"] = bytes_gpu
                img = run_image(be, 10)
                rec["rel_l2_vs_1gpu"] = rel_l2(img, ref)
                rec["bitwise_vs_1gpu"] = bool(np.array_equal(img, ref))
                rec["eager"] = time_backend(be, cp, devices, iters=30, synced=True)
                rec["eager"].update(time_backend(be, cp, devices, iters=50, synced=False))
                print(f"{p} GPU {layout} eager: {json.dumps(rec['eager'])}", flush=True)
                save(out, bench_name(args), res | {"runs": res["runs"] + [rec]})
                be.use_graph(True)
                img_g = run_image(be, 10)
                rec["graph_bitwise_vs_eager"] = bool(np.array_equal(img_g, img))
                rec["graph"] = time_backend(be, cp, devices, iters=30, synced=True)
                rec["graph"].update(time_backend(be, cp, devices, iters=50, synced=False))
                print(f"[{time.perf_counter() - t_start:.0f} s] {p} GPU {layout} graph: {json.dumps(rec['graph'])}", flush=True)
                be.close()
                del be
            except Exception as exc:
                rec["error"] = f"{type(exc).__name__}: {exc}"
                rec["trace"] = traceback.format_exc()[-2000:]
                print(rec["error"], rec["trace"], flush=True)
            res["runs"].append(rec)
            free_pools(cp, range(ndev))
            save(out, bench_name(args), res)
    print(f"[{time.perf_counter() - t_start:.0f} s] SECTION DONE", flush=True)
    for comms in comms_by_p.values():  # the backends are closed: no graph holds these any more
        for c in comms:
            c.destroy()
    print(f"[{time.perf_counter() - t_start:.0f} s] communicators destroyed", flush=True)


def section_overlap(args, out: Path) -> None:
    """Local layout with the back projection's all-reduce overlapped in chunks (graph and eager)."""
    import cupy as cp
    import numpy as np
    from cupy.cuda import nccl

    from mlemlib.backends.cuda import CudaBackend
    from mlemlib.backends.nccl import NcclBackend

    t_start = time.perf_counter()
    ndev = cp.cuda.runtime.getDeviceCount()
    a, at, g, norm, gen_s = make_problem(BIG_DIMS, host=False)
    res: dict = {"dims": BIG_DIMS, "shape": list(a.shape), "nnz": a.nnz, "runs": []}
    one = CudaBackend(a, g, norm, transpose=at, fp="csr_vector", bp="csr_vector")
    ref = run_image(one, 10)
    res["one_gpu"] = time_backend(one, cp, [0], iters=30, synced=True) | time_backend(one, cp, [0], iters=100, synced=False)
    one = None
    free_pools(cp, [0])
    print(f"[{time.perf_counter() - t_start:.0f} s] 1 GPU: {json.dumps(res['one_gpu'])}", flush=True)
    for p in [q for q in (2, 4) if q <= ndev]:
        devices = list(range(p))
        comms = nccl.NcclCommunicator.initAll(devices)
        for chunks in (0, 2, 4, 8):
            rec: dict = {"gpus": p, "layout": "local", "overlap": chunks}
            try:
                be = NcclBackend(a, g, norm, transpose=at, gpus=p, layout="local", comms=comms, overlap=chunks)
                rec["chunk_bounds"] = be.chunk_bounds
                img = run_image(be, 10)
                img2 = run_image(be, 10)
                rec["rel_l2_vs_1gpu"] = rel_l2(img, ref)
                rec["repeat_bitwise"] = bool(np.array_equal(img, img2))
                rec["eager"] = time_backend(be, cp, devices, iters=30, synced=True) | time_backend(be, cp, devices, iters=100, synced=False)
                be.use_graph(True)
                rec["graph_bitwise_vs_eager"] = bool(np.array_equal(run_image(be, 10), img))
                rec["graph"] = time_backend(be, cp, devices, iters=30, synced=True) | time_backend(be, cp, devices, iters=100, synced=False)
                be.close()
                del be
            except Exception as exc:
                rec["error"] = f"{type(exc).__name__}: {exc}"
                rec["trace"] = traceback.format_exc()[-2000:]
            res["runs"].append(rec)
            t1 = res["one_gpu"]["wall_pipelined"]
            if "error" in rec:
                print(rec["error"], rec["trace"], flush=True)
            else:
                print(
                    f"[{time.perf_counter() - t_start:.0f} s] {p} GPUs overlap {chunks}: eager {rec['eager']['wall_pipelined'] * 1e3:.3f} ms "
                    f"graph {rec['graph']['wall_pipelined'] * 1e3:.3f} ms (synced {rec['graph']['wall_synced'] * 1e3:.3f}) "
                    f"speed-up {t1 / rec['graph']['wall_pipelined']:.2f} relL2 {rec['rel_l2_vs_1gpu']:.1e} "
                    f"repeat {rec['repeat_bitwise']} graph=eager {rec['graph_bitwise_vs_eager']}",
                    flush=True,
                )
            free_pools(cp, range(ndev))
            save(out, "overlap.json", res)
        for c in comms:
            c.destroy()
    print(f"[{time.perf_counter() - t_start:.0f} s] SECTION DONE", flush=True)


def section_nccltune(args, out: Path) -> None:
    """Every GPU, graph replay, under this process's NCCL_* settings: all-reduce alone and the iteration (``--matrix``)."""
    import cupy as cp
    from cupy.cuda import nccl

    from mlemlib.backends.nccl import NcclBackend

    ndev = cp.cuda.runtime.getDeviceCount()
    devices = list(range(ndev))
    a, at, g, norm, _ = make_problem(parse_matrix(args.matrix), host=False)
    m, n = a.shape
    comms = nccl.NcclCommunicator.initAll(devices)
    rec = {"nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_") and k != "NCCL_VERSION"}, "gpus": ndev, "matrix": args.matrix}
    rec["allreduce_n_s"] = allreduce_micro(cp, comms, devices, n)
    rec["allreduce_m_s"] = allreduce_micro(cp, comms, devices, m)
    for layout in ("local", "thesis"):
        be = NcclBackend(a, g, norm, transpose=at, gpus=ndev, layout=layout, comms=comms, graph=True)
        rec[layout] = time_backend(be, cp, devices, iters=30, synced=True) | time_backend(be, cp, devices, iters=200, synced=False)
        be.close()
        del be
    print("TUNE " + json.dumps(rec), flush=True)
    for c in comms:
        c.destroy()
    print("SECTION DONE", flush=True)


# --------------------------------------------------------------------------- summary table
def summarize(out: Path) -> str:
    lines = []
    small = json.loads((out / "small.json").read_text()) if (out / "small.json").exists() else None
    if small:
        lines.append(f"correctness ({small.get('shape')}, {small.get('nnz')} nnz, {ITERS_CHECK} it.): gpus layout relL2 bit1gpu repeat graph=eager")
        for r in small["runs"]:
            if "error" in r:
                lines.append(f"  {r['gpus']} {r['layout']}: ERROR {r['error']}")
            else:
                lines.append(
                    f"  {r['gpus']} {r['layout']:6} {r['rel_l2_vs_1gpu']:.2e} {r['bitwise_vs_1gpu']} {r['repeat_bitwise']} {r['graph_bitwise_vs_eager']}"
                )
        for r in small["mpi"]:
            lines.append(
                f"  ranks {r['ranks']} {r['layout']:6} codes {r['exit_codes']} relL2 {r.get('rel_l2_vs_1gpu', float('nan')):.2e} "
                f"same-as-1proc {r.get('bitwise_vs_one_process')} ({r['seconds']:.0f} s)"
            )
    for bf in sorted(out.glob("bench*.json")):
        lines.extend(_summarize_bench(json.loads(bf.read_text()), bf.name))
    return "\n".join(lines)


def _summarize_bench(bench: dict, name: str) -> list[str]:
    lines = []
    if bench and bench.get("one_gpu"):
        t1 = bench["one_gpu"]["wall_pipelined"]
        lines.append(
            f"{name}: scaling ({bench['shape']}, {bench['nnz']} nnz, grid cap {bench.get('waves')} waves; 1-GPU CudaBackend {t1 * 1e3:.3f} ms/it pipelined, "
            f"{bench['one_gpu']['wall_synced'] * 1e3:.3f} synced; copy bw {bench['copy_bandwidth'] / 1e12:.2f} TB/s)"
        )
        lines.append("  gpus layout mode   fp     bp     allred  upd/corr  it(sync) it(pipe) speedup eff  relL2   GB/s/GPU")
        for r in bench["runs"]:
            if "error" in r:
                lines.append(f"  {r['gpus']} {r['layout']} ERROR {r['error']}")
                continue
            for mode in ("eager", "graph"):
                t = r.get(mode)
                if not t:
                    continue
                sp = t1 / t["wall_pipelined"]
                lines.append(
                    f"  {r['gpus']}    {r['layout']:6} {mode:6} {t.get('fp', 0) * 1e3:6.3f} {t.get('bp', 0) * 1e3:6.3f} "
                    f"{t.get('allreduce', 0) * 1e3:6.3f}  {(t.get('update', 0) + t.get('corr', 0)) * 1e3:6.3f}    "
                    f"{t['wall_synced'] * 1e3:7.3f} {t['wall_pipelined'] * 1e3:7.3f}  {sp:5.2f}  {sp / r['gpus']:4.2f} {r['rel_l2_vs_1gpu']:.1e} "
                    f"{max(r.get('bytes_per_gpu') or [0]) / t['wall_pipelined'] / 1e9:8.0f}"
                )
        for r in bench["allreduce"]:
            lines.append(f"  allreduce {r['gpus']} GPUs {r['vector']}: {r['median_s'] * 1e6:.1f} us")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--all", action="store_true", help="env, lease, small, bench; then the table")
    ap.add_argument("--section", choices=("env", "lease", "small", "bench", "parts", "overlap", "nccltune", "rank", "summary"))
    ap.add_argument("--matrix", default="tor", help="bench/parts: tor (Matrix-2 voxel grid, 8.0e8 nnz) or madpet2[:RAYS]")
    ap.add_argument("--out", default=None)
    ap.add_argument("--work", default=None)
    ap.add_argument("--layout", default="local")
    ap.add_argument("--parts", type=int, default=2)
    ap.add_argument("--bootstrap", default="file")
    ap.add_argument("--dims", type=int, nargs=5, default=None, metavar=("NX", "NY", "NZ", "ANGLES", "OFFSETS"))
    ap.add_argument("--waves", type=int, default=None, help="grid cap of the row kernels in waves (0: none; default the library's)")
    ap.add_argument("--only", nargs="*", default=None, help="with --all: run only these sections")
    ap.add_argument("--small-timeout", type=int, default=200)
    ap.add_argument("--bench-timeout", type=int, default=330)
    args = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.INFO if args.section in ("rank",) else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    out = out_dir(args)
    if args.waves is not None:
        from mlemlib.backends import _cuda_plan as plan

        plan.WAVES = args.waves  # launch_shape reads it at each launch (and at graph capture)
    if args.all:
        t0 = time.perf_counter()
        for name in ("env", "lease"):
            if args.only and name not in args.only:
                continue
            try:
                globals()[f"section_{name}"](args, out)
            except Exception:
                traceback.print_exc()
        me = [sys.executable, str(Path(__file__).resolve()), "--out", str(out)]
        for name, limit in (("small", args.small_timeout), ("bench", args.bench_timeout), ("overlap", args.bench_timeout)):
            if args.only and name not in args.only:
                continue
            t1 = time.perf_counter()
            logf = out / f"{name}.log"
            with open(logf, "w") as log:
                p = subprocess.Popen(me + ["--section", name], stdout=log, stderr=subprocess.STDOUT)
                done_at = None
                while p.poll() is None and time.perf_counter() - t1 < limit:
                    time.sleep(1)
                    if done_at is None and "SECTION DONE" in logf.read_text():
                        done_at = time.perf_counter()
                    if done_at is not None and time.perf_counter() - done_at > 30:
                        break
                if p.poll() is None:
                    p.kill()
                    p.wait()
                    why = "hung at exit (killed 30 s after SECTION DONE)" if done_at else f"TIMED OUT after {limit} s"
                    print(f"section {name}: {why}", flush=True)
                else:
                    print(f"section {name}: rc={p.returncode} in {time.perf_counter() - t1:.0f} s", flush=True)
            print(logf.read_text()[-3000:], flush=True)
        print(f"total {time.perf_counter() - t0:.0f} s", flush=True)
        print(summarize(out))
        return 0
    if args.section == "summary":
        print(summarize(out))
        return 0
    globals()[f"section_{args.section}"](args, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
