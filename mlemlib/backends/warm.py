"""Compile, once per machine, what each GPU job of a workflow would otherwise compile at its start.

On a machine whose caches are empty, a GPU job spends seconds before its
first iteration compiling: the NVRTC builds of this package's kernels
(``mlemlib/kernels/*.cu``: about a second for each ``spmv.cu`` build, some
twenty for ``compressed.cu``), CuPy's own element-wise and reduction
kernels (compiled on their first use in each process), and the host
functions Numba compiles. All of them land in caches on disk (CuPy's kernel
cache, ``~/.cupy/kernel_cache`` or ``$CUPY_CACHE_DIR``; Numba's
``__pycache__`` beside the package), keyed by the code, its options, the
types and the GPU's architecture, not by the matrix's size. :func:`warm_up`
fills them: every build compiled at once in background threads, then each
configured kernel choice run on a small matrix, the host's Numba functions
compiled in a process of their own, so that the workflow's
``warm_kernels`` job does this once, while the matrix is generated, and the
GPU jobs find their kernels compiled.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from mlemlib.backends import graph_option

log = logging.getLogger(__name__)

#: The small matrix: a synthetic scanner in sinogram order (:func:`mlemlib.bench.tor_matrix`).
SMALL = {"nx": 24, "ny": 24, "nz": 2, "n_angles": 24, "n_offsets": 32}


def small_problem() -> tuple[Any, np.ndarray, np.ndarray]:
    """A small CSR matrix, its measurement ``g = A 1`` (float32) and norm (float64)."""
    from mlemlib.bench import tor_matrix

    a = tor_matrix(**SMALL)
    s = a.to_scipy().astype(np.float64)
    g = np.asarray(s @ np.ones(a.shape[1]), dtype=np.float32)
    norm = np.asarray(s.sum(axis=0)).ravel()
    return a, g, norm


def run_choices(runs: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The distinct kernel choices of the cuda ``runs`` (dicts with fp, bp, secsize, graph, gpus,
    layout): a multi-GPU run counts as its layout on one GPU."""
    out: dict[tuple, dict[str, Any]] = {}
    for run in runs:
        if run.get("backend", "cuda") != "cuda":
            continue
        graph = graph_option(run.get("graph"))  # auto (None): as the backend decides on one GPU
        multi = int(run.get("gpus") or 1) > 1 or graph is True
        choice = {"fp": run.get("fp") or "auto", "bp": run.get("bp") or "auto", "secsize": run.get("secsize"),
                  "nccl": multi, "layout": (run.get("layout") or "local") if multi else "local", "graph": graph}
        out.setdefault(tuple(sorted(choice.items(), key=lambda kv: kv[0])), choice)
    return list(out.values())


def warm_up(runs: Iterable[Mapping[str, Any]], *, formats: Sequence[str] = ("csr",), subsets: int = 1,
            background: bool = False, bench: bool = False, reference: bool = True,
            host: bool = True) -> dict[str, Any]:
    """Compile every kernel build for GPU 0 (the job's GPU) and run each kernel choice of ``runs`` (see
    :func:`run_choices`) on a small matrix in each of ``formats``; with ``subsets`` > 1 also as OSEM (two subsets),
    with ``background`` with a background term; with ``bench`` what the SpMV benchmark adds (cuSPARSE); and the
    copy-bandwidth measurement every GPU run makes. The host's Numba functions (the float64 reference's iteration with
    ``reference``, the benchmark's problem and float64 products, the chunked layout) compile meanwhile in a
    process of their own (:func:`warm_host`; ``host`` False: not). The builds compile in background threads while the choices run,
    each choice waiting only for its own. A choice that fails here is logged and left (its run reports it).

    Returns
    -------
    dict
        ``seconds``, ``builds`` (labels), ``choices`` (each with ``seconds``, and ``error`` where it failed),
        ``host`` (the host process's exit status).
    """
    import subprocess
    import sys

    from mlemlib.backends import _build
    from mlemlib.backends import _cuda_kernels as ck
    from mlemlib import registry
    from mlemlib.formats.spec import matrix_format_of

    t0 = time.perf_counter()
    builds = ck.kernel_builds([k for k in registry.KERNELS if k.backend == "cuda"])
    _build.prefetch(builds, 0)
    proc = None
    if host:  # a fresh interpreter (not multiprocessing, which would run the calling script again)
        proc = subprocess.Popen([sys.executable, "-c", "from mlemlib.backends.warm import warm_host; "
                                 f"warm_host(reference={bool(reference)}, bench={bool(bench)})"])
    a, g, norm = small_problem()
    done: list[dict[str, Any]] = []
    for fmt in formats:
        matrix = _compressed(a, fmt) if matrix_format_of(fmt).compressed else a
        for choice in run_choices(runs):
            for s in sorted({1, min(int(subsets), 2)}):  # MLEM, and OSEM (two subsets) where runs have S > 1
                done.append(_timed({**choice, "format": fmt, "subsets": s}, _run_choice, matrix, g, norm, choice,
                                   s, background))
    if bench:
        cusparse = {"fp": "cusparse", "bp": "cusparse", "secsize": None, "nccl": False, "layout": "local",
                    "graph": False}
        done.append(_timed({**cusparse, "format": "csr"}, _run_choice, a, g, norm, cusparse, 1, False))
    # Every GPU run measures its GPUs' copy bandwidth before its first iteration: CuPy's reduction in its check
    # compiled there, 4-6 s in each of the first jobs to start together on a fresh machine.
    done.append(_timed({"copy_bandwidth": True}, _copy_bandwidth))
    for build in builds:
        _build.module(build, 0)
    log.info("compiled %d kernel builds (%.1f s)", len(builds), time.perf_counter() - t0)
    status = None
    if proc is not None:
        try:
            status = proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
            status = proc.wait()
        if status != 0:
            log.warning("the host functions' warm-up ended with status %s", status)
    seconds = time.perf_counter() - t0
    log.info("kernels warmed up in %.1f s: %d builds, %d choices (%d failed)", seconds, len(builds), len(done),
             sum("error" in d for d in done))
    return {"seconds": round(seconds, 3), "builds": [" ".join((b.source, *b.options)) for b in builds],
            "choices": done, "host": status}


def write_record(record: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Write a warm-up's record (what :func:`warm_up` returns) to ``path`` as JSON, atomically.

    Parameters
    ----------
    record
        The record: ``seconds``, ``builds``, ``choices``, ``host``, or ``error`` where nothing was compiled.
    path
        The file; a temporary file beside it is renamed to it once written, so that no reader (or job
        interrupted meanwhile) sees a partial record.
    """
    import json

    from mlemlib._io import atomic_path

    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(record, indent=1) + "\n")


def warm_host(reference: bool = True, bench: bool = False) -> None:
    """Compile the host's Numba functions a workflow's jobs call, on the small matrix (their caches on
    disk): the decoder of a compressed container and the norm's and the measurement's passes over the
    matrix (which start as soon as it is written), the float64 reference's iteration, the chunked layout,
    and with ``bench`` the benchmark's problem and float64 products."""
    from mlemlib import chunked
    from mlemlib.compressed import CompressedMatrix
    from mlemlib.formats.spec import COMPRESSED, COMPRESSED_U16
    from mlemlib.norm import column_sums
    from mlemlib.phantom import project_images

    a, g, norm = small_problem()
    for spec in (COMPRESSED, COMPRESSED_U16):
        CompressedMatrix.from_csr(a, spec.name).to_csr()
    column_sums(a)
    project_images(a, [np.ones(a.shape[1])])
    if reference:
        _cpu_reference(a, g, norm)
    for _ in chunked.layout_blocks(a, "csr", window=chunked.DEFAULT_WINDOW):
        pass
    if bench:
        from mlemlib.bench.prepare import problem_arrays
        from mlemlib.bench.spmv import _reference_products, bench_vectors
        from mlemlib.matrix import CSRMatrix

        problem_arrays(a)
        x, c = bench_vectors(*a.shape)
        _reference_products(a, CSRMatrix.from_scipy(a.to_scipy().T.tocsr()), x, c)


def _timed(what: dict[str, Any], fn: Any, *args: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    out = dict(what)
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - a warm-up failure is the run's to report
        log.warning("warm-up of %s failed (the run reports it): %s", what, exc)
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def _compressed(a: Any, fmt: str) -> Any:
    from mlemlib.compressed import CompressedMatrix

    return CompressedMatrix.from_csr(a, fmt)


def _cpu_reference(a: Any, g: np.ndarray, norm: np.ndarray) -> None:
    from mlemlib.backends import make_backend

    be = make_backend("cpu", a, g, norm, dtype=np.float64)
    f = be.initial_image()
    for _ in range(2):
        f = be.iterate(f)


def _run_choice(matrix: Any, g: np.ndarray, norm: np.ndarray, choice: Mapping[str, Any], subsets: int,
                background: bool) -> None:
    from mlemlib.backends import make_backend

    m = int(matrix.shape[0])
    kw: dict[str, Any] = {"fp": choice["fp"], "bp": choice["bp"]}
    if choice.get("secsize"):
        kw["secsize"] = choice["secsize"]
    if background:
        kw["background"] = np.full(m, 0.05, dtype=np.float32)
    if subsets > 1:  # OSEM (two subsets) on one GPU, graphs as the run asks
        from mlemlib.formats import open_source
        from mlemlib.norm import sensitivities
        from mlemlib.subsets import update_norms

        bounds = np.array([0, m // 2, m], dtype=np.int64)
        be = make_backend("cuda", matrix, g, update_norms(sensitivities(open_source(matrix), bounds)), subsets=bounds,
                          graph=choice["graph"], **kw)
    elif choice["nccl"]:  # the multi-GPU backend in the run's layout, on one GPU
        from mlemlib.backends.nccl import NcclBackend

        be = NcclBackend(matrix, g, norm, devices=[0], layout=choice["layout"], graph=choice["graph"], **kw)
    else:
        be = make_backend("cuda", matrix, g, norm, **kw)
    try:
        f = be.initial_image()
        for _ in range(2):
            f = be.iterate(f)
        be.to_host(f)
    finally:
        close = getattr(be, "close", None)
        if close is not None:
            close()


def _copy_bandwidth() -> None:
    from mlemlib.devices import copy_bandwidth

    copy_bandwidth(1 << 24, repeat=2, warmup=1)
