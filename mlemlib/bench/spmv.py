"""``mlem bench spmv`` (the workflow's ``bench_spmv`` rule): every projection kernel and kernel pair on one
matrix, through the public backend interface (CUDA; the report formatting is host only).

:func:`bench_spmv` builds backends with :func:`mlemlib.backends.make_backend`,
the kernel chosen through ``fp``/``bp``, and times

- each forward kernel's ``forward(x)`` and each back-projection kernel's
  ``back(c)`` (on the stored transpose, and without it), CUDA events around
  each call (:func:`mlemlib.bench.timing.time_calls`), with the effective
  bandwidth (the bytes the product reads and writes over the time), its
  fraction of the copy bandwidth measured in the same run
  (:func:`mlemlib.devices.copy_bandwidth`), its speed relative to cuSPARSE and
  its error against a float64 product on the host;
- whole MLEM iterations of kernel pairs (:data:`ITERATION_BENCH`; in each
  further format of ``formats``, :data:`FORMAT_ITERATION_BENCH` on the matrix
  converted by :func:`mlemlib.formats.convert`) against their floor.

:func:`format_markdown`, :func:`format_csv`, :func:`write_results` write the
report (JSON, Markdown, and the CSV the workflow's summary reads).
"""

from __future__ import annotations

import concurrent.futures
import csv
import datetime as _dt
import io
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mlemlib import registry
from mlemlib.errors import ConfigError
from mlemlib.formats.spec import CSR, matrix_format_of

log = logging.getLogger(__name__)

#: Kernels timed by default, per operation: every cuda kernel of the registry that reads CSR (selectors left out).
FP_BENCH = tuple(registry.names("cuda", "forward", fmt=CSR.name))
BP_BENCH = tuple(registry.names("cuda", "back", fmt=CSR.name))
NOTRANS_BENCH = tuple(
    k.name for k in registry.KERNELS
    if k.backend == "cuda" and k.op == "back_notrans" and not k.selector and CSR.name in k.formats
)
#: (fp, bp) pairs timed as whole MLEM iterations.
ITERATION_BENCH = (
    ("auto", "auto"),
    ("cusparse", "cusparse"),
    ("csr_vector", "csr_vector"),
    ("csr_vector", "scatter"),
    ("csr_vector", "scatter_smem"),
    ("merge", "scatter"),
    ("auto", "onepass"),
    ("auto", "onepass_fixed"),
    ("auto", "onepass_chunked"),
)
#: (fp, bp) pairs timed as whole MLEM iterations on the matrix converted to a compressed format.
FORMAT_ITERATION_BENCH = (
    ("auto", "auto"),
    ("delta_vector", "delta_vector"),
    ("auto", "onepass_fixed"),
    ("auto", "onepass_chunked"),
)
#: The iteration every other one's image is compared with: the deterministic float32 CSR pair.
REFERENCE_ITERATION = ("csr", "csr_vector", "csr_vector")
#: The benchmark's operation names and the registry's.
BENCH_OPS = {"fp": "forward", "bp": "back", "bp_notrans": "back_notrans"}
#: The partner of a kernel timed alone: the deterministic CSR kernel of the other projection.
PARTNER = "csr_vector"


def deterministic(op: str, kernel: str) -> bool:
    """Whether the registry declares kernel ``kernel`` of bench operation ``op`` deterministic."""
    return registry.get("cuda", BENCH_OPS[op], kernel).deterministic


def check_formats(formats: Sequence[str]) -> tuple[str, ...]:
    """``formats`` as a tuple without repeats, each a matrix format (:class:`ConfigError` otherwise)."""
    out = tuple(dict.fromkeys(str(f) for f in formats))
    bad = [f for f in out if f not in registry.FORMATS]
    if bad or not out:
        raise ConfigError("formats", f"expected some of {', '.join(registry.FORMATS)}, got {', '.join(formats) or 'none'}")
    return out


def spmv_bytes(rows: int, cols: int, nnz: int) -> int:
    """Bytes one CSR product ``y = A x`` reads and writes: values and columns (8 per non-zero), the row
    pointer (8 per row), ``x`` once (4 per column) and ``y`` (4 per row)."""
    return 8 * nnz + 8 * (rows + 1) + 4 * cols + 4 * rows


def _rel_l2(y: np.ndarray, ref: np.ndarray) -> float:
    nref = float(np.linalg.norm(ref))
    d = float(np.linalg.norm(np.asarray(y, dtype=np.float64) - ref))
    return d / nref if nref else d


class _Resident:
    """CSR matrices of the host copied to one GPU once and kept there for every backend of the benchmark
    that reads them as they are (named kernels that are not one pass over ``A``): each backend sets the row
    layout its kernels read (:func:`mlemlib.backends._cuda_kernels.set_row_layouts`), so one copy serves
    them all, and uploading ``A`` and ``A^T`` again for each of some twenty kernels is not timed in the
    benchmark's own time."""

    def __init__(self, device: int) -> None:
        self.device = device
        self._copies: dict[int, tuple[Any, Any]] = {}

    def get(self, host: Any, fp: str, bp: str) -> Any:
        """``host`` on the GPU where ``fp`` and ``bp`` read it as it is, else ``host`` itself."""
        from mlemlib.backends import _cuda_kernels as ck
        from mlemlib.matrix import CSRMatrix

        if host is None or not isinstance(host, CSRMatrix) or "auto" in (fp, bp):
            return host
        kb = registry.get_bp("cuda", bp)
        if kb.op == "iteration" or kb.chunks:
            return host
        key = id(host)
        if key not in self._copies:
            cp = ck.cupy()
            with cp.cuda.Device(self.device):
                self._copies[key] = (host, ck.DeviceCSR.from_host(host))
        return self._copies[key][1]

    def put(self, host: Any, device_copy: Any) -> None:
        """Serve ``device_copy`` (already on the GPU) for ``host``."""
        self._copies[id(host)] = (host, device_copy)

    def clear(self) -> None:
        self._copies.clear()


def _backend(src: Any, g: np.ndarray, norm: np.ndarray, tsrc: Any, fp: str, bp: str, device: int,
             secsize: int | None = None, resident: _Resident | None = None) -> Any:
    from mlemlib.backends import make_backend
    from mlemlib.matrix import CSRMatrix

    kw: dict[str, Any] = {"device": device} if device else {}
    t = tsrc if registry.uses_transpose("cuda", bp) else None
    if resident is not None and isinstance(src, CSRMatrix):  # a compressed A takes its A^T from the host
        src, t = resident.get(src, fp, bp), resident.get(t, fp, bp)
    return make_backend("cuda", src, g, norm, t, fp=fp, bp=bp, secsize=secsize, **kw)


def _reference_products(a: Any, at: Any, x: np.ndarray, c: np.ndarray) -> dict[str, np.ndarray]:
    """``A x`` and ``A^T c`` in float64 on the host, the yardstick of every kernel's product: each row summed
    in its order in float64 (the cpu backend's Numba kernels on every core, on ``A`` and ``A^T`` as they are;
    SciPy on a float64 copy where they are not CSR)."""
    from mlemlib.backends.cpu import spmv as host_spmv
    from mlemlib.matrix import CSRMatrix

    if isinstance(a, CSRMatrix) and isinstance(at, CSRMatrix):
        return {"fp": host_spmv(a.indptr, a.indices, a.data, x, np.empty(a.shape[0], dtype=np.float64)),
                "bp": host_spmv(at.indptr, at.indices, at.data, c, np.empty(at.shape[0], dtype=np.float64))}
    a64 = a.to_scipy().astype(np.float64)
    return {"fp": a64 @ x.astype(np.float64), "bp": a64.T @ c.astype(np.float64)}


def bench_vectors(m: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The image ``x`` (length ``n``) and correlation ``c`` (length ``m``) every product of the benchmark
    takes: uniform in [0.5, 1.5), seeded."""
    rng = np.random.default_rng(1)
    x = rng.uniform(0.5, 1.5, n).astype(np.float32)
    c = rng.uniform(0.5, 1.5, m).astype(np.float32)
    return x, c


def _kernel_rows(src: Any, tsrc: Any, g: np.ndarray, norm: np.ndarray, *, fp_kernels: Sequence[str],
                 bp_kernels: Sequence[str], notrans_kernels: Sequence[str], secsizes: Sequence[int], repeat: int,
                 warmup: int, bw: float, check: bool, device: int,
                 resident: _Resident | None = None,
                 refs: Callable[[], dict[str, np.ndarray]] | None = None) -> list[dict[str, Any]]:
    """One row per kernel and operation: ``forward``/``back`` of a backend whose ``fp``/``bp`` is that kernel,
    on :func:`bench_vectors`. With ``check``, each product's error against ``refs()`` (the float64 products,
    :func:`_reference_products`; asked for once every kernel is timed, so that the host may compute them
    meanwhile; None: computed here first)."""
    from mlemlib.bench.timing import time_calls

    m, n = (int(v) for v in src.shape)
    nnz = int(src.nnz)
    x, c = bench_vectors(m, n)
    if check and refs is None:
        computed = _reference_products(src, tsrc, x, c)
        refs = lambda: computed  # noqa: E731
    products: list[tuple[dict[str, Any], str, np.ndarray]] = []
    jobs: list[tuple[str, str, int | None]] = []
    for k in fp_kernels:
        jobs += [("fp", k, s) for s in secsizes] if k == "merge" else [("fp", k, None)]
    for k in bp_kernels:
        jobs += [("bp", k, s) for s in secsizes] if k == "merge" else [("bp", k, None)]
    jobs += [("bp_notrans", k, None) for k in notrans_kernels]
    rows = []
    for op, k, secsize in jobs:
        fp, bp = (k, PARTNER) if op == "fp" else (PARTNER, k)
        row: dict[str, Any] = {"op": op, "kernel": k, "secsize": secsize, "deterministic": deterministic(op, k)}
        try:
            be = _backend(src, g, norm, tsrc, fp, bp, device, secsize, resident)
        except ConfigError as exc:
            row["error"] = str(exc)
            log.warning("%s %s not timed: %s", op, k, exc)
            rows.append(row)
            continue
        row.update(launch_of(be.describe(), op))
        vec = _device_vector(be, x if op == "fp" else c)
        call = (lambda: be.forward(vec)) if op == "fp" else (lambda: be.back(vec))
        t = time_calls(call, repeat=repeat, warmup=warmup)
        nbytes = spmv_bytes(m, n, nnz) if op != "bp" else spmv_bytes(n, m, nnz)
        med = float(np.median(t))
        row.update(median_s=med, min_s=float(t.min()), max_s=float(t.max()), bytes=nbytes, bandwidth=nbytes / med,
                   of_copy=nbytes / med / bw)
        if check:
            products.append((row, op, _host(call())))
        log.info("%-10s %-16s %8.3f ms %5.1f%% of copy", op, k, med * 1e3, 100 * nbytes / med / bw)
        rows.append(row)
        del be, vec
        _free(device)
    if check:
        ref = refs()
        for row, op, y in products:
            row["rel_l2"] = _rel_l2(y, ref["bp" if op == "bp_notrans" else op])
    picks = _auto_picks(src, tsrc, g, norm, device)
    for op, kernel in picks.items():
        pick = next((r for r in rows if r["op"] == op and r["kernel"] == kernel and "median_s" in r), None)
        if pick is not None:
            pick["auto"] = True
    for r in rows:
        r.setdefault("auto", False)
    base = {r["op"]: r["median_s"] for r in rows if r["kernel"] in ("cusparse", "cusparse_notrans") and "median_s" in r}
    for r in rows:
        r["vs_cusparse"] = base[r["op"]] / r["median_s"] if r["op"] in base and r.get("median_s") else None
    return rows


def launch_of(desc: dict[str, Any], op: str) -> dict[str, Any]:
    """``lanes`` (per row) and launch ``shape`` of the kernel that computes ``op``, from the backend's
    ``describe()``; None where the kernel has none (cuSPARSE, a scatter without lanes)."""
    side = "fp" if op == "fp" else "bp"
    shape = desc.get(f"shape_{side}")
    return {"lanes": desc.get(f"lanes_{side}"), "shape": None if shape in (None, "", "-") else shape}


def _auto_picks(src: Any, tsrc: Any, g: np.ndarray, norm: np.ndarray, device: int) -> dict[str, str]:
    """The kernel ``auto`` runs for each operation on this matrix and device: ``fp`` and ``bp`` as
    ``fp: auto, bp: auto`` resolve them, ``bp_notrans`` as the ``notrans`` selector does (backends built as
    a run builds them). An operation ``auto`` does not run apart (a one-pass iteration) is left out."""
    picks: dict[str, str] = {}
    for fp, bp, ops in (("auto", "auto", ("fp", "bp")), ("auto", "notrans", ("bp_notrans",))):
        try:
            be = _backend(src, g, norm, tsrc, fp, bp, device)
        except ConfigError as exc:
            log.warning("fp=%s bp=%s: no backend, its choice not marked: %s", fp, bp, exc)
            continue
        chosen = {"fp": be.fp_kernel, "bp": be.bp_kernel, "bp_notrans": be.bp_kernel}
        picks.update((op, chosen[op]) for op in ops)
        del be
        _free(device)
    return picks


def _device_vector(be: Any, v: np.ndarray) -> Any:
    """``v`` on the backend's device (its ``from_host`` is for images of length n: vectors go through CuPy)."""
    import cupy as cp

    with cp.cuda.Device(getattr(be, "device_id", 0)):
        return cp.asarray(v)


def _host(y: Any) -> np.ndarray:
    import cupy as cp

    return cp.asnumpy(y).astype(np.float64)


def _free(device: int) -> None:
    import cupy as cp

    with cp.cuda.Device(device):
        cp.get_default_memory_pool().free_all_blocks()


def _iteration_rows(sources: dict[str, tuple[Any, Any]], g: np.ndarray, norm: np.ndarray, *, repeat: int,
                    warmup: int, bw: float, csr_floor_s: float, device: int,
                    iterations: Sequence[tuple[str, str]], resident: _Resident | None = None) -> list[dict[str, Any]]:
    """Whole iterations per format (``sources``: format -> (A, A^T)) against their floor, images compared."""
    from mlemlib.bench.timing import floor_bytes, time_iterations

    rows, images = [], {}
    for fmt, (a, at) in sources.items():
        pairs = FORMAT_ITERATION_BENCH if matrix_format_of(fmt).compressed else iterations
        facts = {"nnz": int(a.nnz), "bytes": int(getattr(a, "nbytes", 8 * int(a.nnz)))}
        t_bytes = int(getattr(at, "nbytes", 8 * int(at.nnz))) if at is not None else None
        for fp, bp in pairs:
            row: dict[str, Any] = {"format": fmt, "fp_requested": fp, "bp_requested": bp}
            try:
                be = _backend(a, g, norm, at, fp, bp, device, resident=resident)
            except ConfigError as exc:
                row["error"] = str(exc)
                log.warning("iteration %s + %s (%s) not timed: %s", fp, bp, fmt, exc)
                rows.append(row)
                continue
            timed = time_iterations(be, warmup=warmup, iterations=repeat, repeats=1)
            desc = be.describe()
            nbytes = floor_bytes(desc, facts, "cuda", be.bp_kernel, t_bytes)
            med = timed["ms"] / 1e3
            bpn = desc.get("bytes_per_nnz") if isinstance(desc.get("bytes_per_nnz"), dict) else {}
            row.update(fp=be.fp_kernel, bp=be.bp_kernel, deterministic=be.deterministic,
                       fused=desc.get("fused") if isinstance(desc.get("fused"), list) else [],
                       bytes_per_nnz=bpn.get("A"), median_s=med, min_s=timed["ms_min"] / 1e3, floor_bytes=nbytes,
                       floor_s=nbytes / bw, of_floor=nbytes / bw / med, csr_floor_s=csr_floor_s,
                       of_csr_floor=csr_floor_s / med, finite=timed["finite"])
            f = be.initial_image()
            for _ in range(3):
                f = be.iterate(f)
            images[len(rows)] = np.asarray(be.to_host(f), dtype=np.float64)
            log.info("iteration %s + %s (%s): %.3f ms, %.1f%% of its floor", fp, be.bp_kernel, fmt, med * 1e3,
                     100 * row["of_floor"])
            rows.append(row)
            del be
            _free(device)
    ref = next((images.get(i) for i, r in enumerate(rows)
                if (r.get("format"), r.get("fp_requested"), r.get("bp_requested")) == REFERENCE_ITERATION), None)
    for i, r in enumerate(rows):
        if ref is not None and i in images:
            r["rel_l2_to_csr"] = _rel_l2(images[i], ref)
    return rows


def _host_work(a: Any, at: Any, x: np.ndarray, c: np.ndarray, check: bool) -> tuple[Any, Any, dict, float]:
    """The benchmark's host work on ``A``, run beside the timed kernels on all of Numba's threads but two (the
    thread that launches and times the kernels keeps a core): ``(g, norm)`` of
    :func:`~mlemlib.bench.prepare.problem_arrays`, with ``check`` the float64 products of
    :func:`_reference_products`, and its seconds."""
    import numba

    from mlemlib.bench.prepare import problem_arrays

    t0 = time.perf_counter()
    numba.set_num_threads(max(1, numba.config.NUMBA_NUM_THREADS - 2))  # this thread's setting only
    g, norm = problem_arrays(a)
    refs = _reference_products(a, at, x, c) if check else {}
    return g, norm, refs, time.perf_counter() - t0


def _prefetch(fp_kernels: Sequence[str], bp_kernels: Sequence[str], notrans_kernels: Sequence[str],
              iterations: Sequence[tuple[str, str]], format_iterations: Sequence[tuple[str, str]],
              device: int) -> None:
    """Start compiling every kernel the benchmark runs on GPU ``device`` in the background
    (:func:`mlemlib.backends._cuda_kernels.prefetch_kernels`), while the matrix is read: the named kernels,
    their partner and the kernels of the iterations' pairs."""
    from mlemlib.backends import _cuda_kernels as ck

    names = {PARTNER, *fp_kernels, *bp_kernels, *notrans_kernels}
    names.update(k for pair in (*iterations, *format_iterations) for k in pair)
    try:
        ck.prefetch_kernels([k for k in registry.KERNELS if k.backend == "cuda" and k.name in names], device)
    except Exception as exc:  # noqa: BLE001 - an optimisation: the backends report a GPU they cannot use
        log.debug("kernels not compiled ahead on GPU %s: %s", device, exc)


def _transpose(a: Any, device: int) -> tuple[Any, Any | None]:
    """``A^T`` in host memory for the benchmark, and ``(A, A^T)`` on GPU ``device`` where they were made
    there (else None): transposed on the GPU with cuSPARSE where ``A`` (CSR) fits its 32-bit indices and the
    GPU's memory (faster than reading a stored ``A^T`` from disk; the copies serve the benchmark's backends,
    :class:`_Resident`), else by ScanTrans on the host (the transposition stage's method)."""
    from mlemlib.backends import _cuda_kernels as ck
    from mlemlib.matrix import CSRMatrix
    from mlemlib.transpose import transpose as transpose_matrix

    if isinstance(a, CSRMatrix) and a.nnz <= registry.CUSPARSE_MAX_NNZ:
        cp = ck.cupy()
        try:
            with cp.cuda.Device(device):
                d = ck.DeviceCSR.from_host(a)
                t = d.transpose()
                d.drop_cusparse()
                return t.to_host(), (d, t)
        except cp.cuda.memory.OutOfMemoryError as exc:
            log.info("A^T does not fit GPU %d beside A (%s): transposed on the host", device, exc)
            cp.get_default_memory_pool().free_all_blocks()
    return transpose_matrix(a), None


def bench_spmv(
    matrix: Any,
    transpose: Any | None = None,
    *,
    repeat: int = 50,
    warmup: int = 5,
    fp_kernels: Sequence[str] = FP_BENCH,
    bp_kernels: Sequence[str] = BP_BENCH,
    notrans_kernels: Sequence[str] = NOTRANS_BENCH,
    iterations: Sequence[tuple[str, str]] = ITERATION_BENCH,
    formats: Sequence[str] = ("csr",),
    secsizes: Sequence[int] = (5,),
    check: bool = True,
    copy_bytes: int = 1 << 31,
    device: int = 0,
    matrix_label: str | None = None,
    out_json: str | os.PathLike | None = None,
    out_md: str | os.PathLike | None = None,
    out_csv: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Time every projection kernel and kernel pair on one matrix; see the module docstring.

    Parameters
    ----------
    matrix
        ``A``: a path (``.h5``, ``.csr4``...), an opened matrix or a :class:`~mlemlib.matrix.CSRMatrix`;
        read into host memory as CSR once (a compressed container is decoded; its own format's
        iterations are added).
    transpose
        ``A^T`` in the same forms; None: transposed here (:func:`_transpose`).
    repeat, warmup
        Timed and untimed calls (iterations) per kernel (pair).
    fp_kernels, bp_kernels, notrans_kernels
        Forward kernels, back projections on the stored transpose and without it.
    iterations
        ``(fp, bp)`` pairs timed as whole iterations in CSR (empty: none).
    formats
        Formats the iterations run in: ``csr`` and the compressed ones (the matrix converted).
    secsizes
        Section sizes of ``merge`` (one row each).
    check
        Compare every product with a float64 one on the host.
    copy_bytes
        Buffer of the copy-bandwidth measurement.
    device
        CUDA device index.
    matrix_label
        The matrix's name in the report.
    out_json, out_md, out_csv
        Where to write the report (atomically); None: not written.
    """
    from mlemlib.devices import EnergyMeter, capped_between, copy_bandwidth, device_facts
    from mlemlib.formats import convert, open_source, write_matrix_h5
    from mlemlib.matrix import CSRMatrix

    if repeat < 1 or warmup < 0:
        raise ConfigError("repeat", f"repeat must be >= 1 and warmup >= 0, got {repeat}, {warmup}")
    formats = check_formats(formats)
    label = matrix_label or (os.fspath(matrix) if isinstance(matrix, (str, os.PathLike)) else "in-memory")
    src = open_source(matrix, "matrix")
    own = matrix_format_of(src).name
    if own not in formats:
        formats = (*formats, own)
    m, n = (int(v) for v in src.shape)
    plain = [f for f in formats if not matrix_format_of(f).compressed]  # read as the CSR arrays a, at
    others = [f for f in formats if matrix_format_of(f).compressed]  # converted, read from their files
    _prefetch(fp_kernels, bp_kernels, notrans_kernels, iterations if plain else (),
              FORMAT_ITERATION_BENCH if others else (), device)
    t0 = time.perf_counter()
    a = src if isinstance(matrix, CSRMatrix) else src.read_rows(0, m)
    a = getattr(a, "matrix", a)
    on_gpu = None
    if transpose is not None:
        at = open_source(transpose, "transpose").read_rows(0, n)
    else:
        at, on_gpu = _transpose(a, device)
    log.info("%s: %d x %d, %d nnz, A and A^T in host memory in %.1f s", label, m, n, a.nnz, time.perf_counter() - t0)
    # g and the norm (the iterations' problem) and the float64 products on the host's other cores while the
    # kernels are timed alone (the only Numba work until result())
    x, c = bench_vectors(m, n)
    pool = concurrent.futures.ThreadPoolExecutor(1, "mlem-bench-host")
    host = pool.submit(_host_work, a, at, x, c, check)
    pool.shutdown(wait=False)  # no further work; the one submitted runs on
    resident = _Resident(device)
    if on_gpu is not None:
        resident.put(a, on_gpu[0])
        resident.put(at, on_gpu[1])
    del on_gpu
    with EnergyMeter([device]) as meter:
        facts = device_facts(device)
        caps0, t_run = meter.capped(), time.perf_counter()
        copy = copy_bandwidth(copy_bytes, device=device)
        bw = copy["bandwidth"]
        _free(device)
        log.info("copy bandwidth %.3f TB/s", bw / 1e12)
        # forward(x) and back(c) alone read neither g nor the norm: any valid pair builds their backends
        unit_g, unit_norm = np.ones(m, dtype=np.float32), np.ones(n, dtype=np.float64)
        kernels = _kernel_rows(a, at, unit_g, unit_norm, fp_kernels=fp_kernels, bp_kernels=bp_kernels,
                               notrans_kernels=notrans_kernels, secsizes=secsizes, repeat=repeat, warmup=warmup,
                               bw=bw, check=check, device=device, resident=resident,
                               refs=lambda: host.result()[2])
        g, norm, _, host_s = host.result()
        log.info("g, the norm and the float64 products on the host in %.1f s", host_s)
        its: list[dict[str, Any]] = []
        if iterations and a.nnz:
            csr_floor_s = (2 * (8 * a.nnz) + 8 * (m + 1) + 8 * (n + 1)) / bw
            with tempfile.TemporaryDirectory(prefix="mlem-bench-") as tmp:
                sources: dict[str, tuple[Any, Any]] = {f: (a, at) for f in plain}
                if others:
                    base = Path(tmp) / "csr.h5"
                    write_matrix_h5(base, a)
                    for fmt in others:
                        path = Path(tmp) / f"{fmt}.h5"
                        convert(base, path, fmt=fmt)
                        sources[fmt] = (open_source(path), at)
                its = _iteration_rows(sources, g, norm, repeat=repeat, warmup=warmup, bw=bw,
                                      csr_floor_s=csr_floor_s, device=device, iterations=iterations,
                                      resident=resident)
                for fmt, (s, _) in sources.items():
                    if matrix_format_of(fmt).compressed and hasattr(s, "close"):
                        s.close()
        resident.clear()
        _free(device)
        clocks = {"run_s": time.perf_counter() - t_run, "capped_s": capped_between(caps0, meter.capped()),
                  "note": "NVML clock-capping counters" if meter.caps_available else meter.note or "not available"}
    lengths = np.diff(a.indptr)
    col_lengths = np.diff(at.indptr)
    result = {
        "date": _dt.date.today().isoformat(),
        "device": facts,
        "copy": copy,
        "repeat": repeat,
        "warmup": warmup,
        "matrix": {
            "label": label,
            "format": own,
            "shape": [m, n],
            "nnz": int(a.nnz),
            "bytes": 8 * int(a.nnz) + 8 * (m + 1),
            "mean_row_length": float(lengths.mean()) if m else 0.0,
            "max_row_length": int(lengths.max()) if m else 0,
            "empty_rows": int((lengths == 0).sum()),
            "mean_col_length": float(col_lengths.mean()) if n else 0.0,
            "max_col_length": int(col_lengths.max()) if n else 0,
            "empty_cols": int((col_lengths == 0).sum()),
        },
        "kernels": kernels,
        "iterations": its,
        "clocks": clocks,
    }
    write_results(result, out_json=out_json, out_md=out_md, out_csv=out_csv)
    return result


# --------------------------------------------------------------------------- reports
OP_TITLES = {"fp": "forward A x", "bp": "back A^T c (stored transpose)", "bp_notrans": "back A^T c (no transpose)"}


def _fmt(v: Any, spec: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return format(v, spec)


def kernel_label(row: dict[str, Any]) -> str:
    """``csr_vector``, ``merge (secsize 5)``... for tables."""
    k = row["kernel"]
    return f"{k} (secsize {row['secsize']})" if row.get("secsize") is not None else k


def auto_versus_fastest(iterations: Sequence[dict[str, Any]]) -> str:
    """What ``auto`` + ``auto`` ran and its time beside the fastest iteration in the same format of the same run.

    One sentence per format with an ``auto`` + ``auto`` row (the CSR one without a format prefix); "" without one.
    """
    done = [r for r in iterations if "error" not in r]
    lines = []
    for fmt in dict.fromkeys(r.get("format", "csr") for r in done):
        same = [r for r in done if r.get("format", "csr") == fmt]
        auto = next((r for r in same if r.get("fp_requested") == "auto" and r.get("bp_requested") == "auto"), None)
        if auto is None:
            continue
        best = min(same, key=lambda r: r["median_s"])
        best_det = min((r for r in same if r["deterministic"]), key=lambda r: r["median_s"], default=None)
        named = matrix_format_of(fmt).compressed  # CSR, the reference, goes without its name
        where = f"{fmt}: " if named else ""
        text = (f"{where}auto ran {auto['fp']} + {auto['bp']}: {auto['median_s'] * 1e3:.3f} ms; the fastest "
                f"iteration of this run{' in ' + fmt if named else ''} is {best['fp']} + {best['bp']}: "
                f"{best['median_s'] * 1e3:.3f} ms (auto takes {auto['median_s'] / best['median_s']:.2f}x its time)")
        if best_det is not None and best_det is not best:
            text += (f"; the fastest deterministic one is {best_det['fp']} + {best_det['bp']}: "
                     f"{best_det['median_s'] * 1e3:.3f} ms")
        lines.append(text + ".")
    return "\n\n".join(lines)


def clock_line(clocks: dict[str, Any]) -> str:
    """The report's line on the GPU's clocks during the run: how long its power limit or heat held them down."""
    capped = clocks.get("capped_s")
    if not capped:
        return f"- clock capping during the run: not measured ({clocks.get('note') or 'no NVML counters'})"
    held = sum(capped.values())
    text = (f"- clock capping during the run (NVML): held down by the power limit {capped['power']:.2f} s, "
            f"by heat {capped['thermal']:.2f} s, of {clocks['run_s']:.1f} s")
    if held > 0:
        text += "; a capped GPU lowers its SM clock, which slows kernels bound by L1/L2 gathers and atomics"
    return text


def _capped_cell(capped: dict[str, float] | None) -> str:
    return "-" if not capped else f"{sum(capped.values()):.2f}"


def format_markdown(result: dict[str, Any]) -> str:
    """The benchmark report as Markdown (device, matrix, one table per operation, iterations)."""
    d, mtx, cp_ = result["device"], result["matrix"], result["copy"]
    lines = [
        f"## SpMV benchmark: {mtx['label']}",
        "",
        f"- date: {result['date']}; device: {d.get('name', '?')}"
        + (f" (theoretical {d['theoretical_bandwidth'] / 1e12:.2f} TB/s)" if d.get("theoretical_bandwidth") else ""),
        f"- measured copy bandwidth (read + write): {cp_['bandwidth'] / 1e12:.3f} TB/s",
        (
            f"- matrix: {mtx['shape'][0]} x {mtx['shape'][1]}, {mtx['nnz']} nnz ({mtx['bytes'] / 1e9:.2f} GB as CSR"
            + (f"; the file is {mtx['format']}, decoded for the kernels"
               if matrix_format_of(mtx.get("format", "csr")).compressed else "")
            + "), "
            f"row length mean {mtx['mean_row_length']:.1f} max {mtx['max_row_length']}, "
            f"{mtx['empty_rows']} empty rows, {mtx['empty_cols']} empty columns"
        ),
        (
            f"- kernels: median of {result['repeat']} calls of the backend's forward / back after "
            f"{result['warmup']} warm-up calls (CUDA events); iterations: median of {result['repeat']}; "
            "bandwidth = (8 B per nnz + row pointer + vectors) / time; 'vs cuSPARSE' = cuSPARSE time / kernel time"
        ),
    ]
    if result.get("clocks"):
        lines.append(clock_line(result["clocks"]))
    lines.append("")
    for op in ("fp", "bp", "bp_notrans"):
        rows = [r for r in result["kernels"] if r["op"] == op]
        if not rows:
            continue
        lines += [
            f"### {OP_TITLES[op]}",
            "",
            "| kernel | deterministic | median ms | TB/s | of copy bw | vs cuSPARSE | rel. L2 error |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            if "error" in r:
                lines.append(f"| {kernel_label(r)} | {'yes' if r['deterministic'] else 'no'} | not run: "
                             f"{r['error']} | | | | |")
                continue
            lines.append(
                f"| {kernel_label(r)} | {'yes' if r['deterministic'] else 'no'} | {r['median_s'] * 1e3:.3f} | "
                f"{r['bandwidth'] / 1e12:.3f} | {_fmt(r['of_copy'], '.1%')} | {_fmt(r.get('vs_cusparse'), '.2f')} | "
                f"{_fmt(r.get('rel_l2'), '.1e')} |"
            )
        lines.append("")
    if result.get("iterations"):
        lines += [
            "### one MLEM iteration",
            "",
            "| format | bytes/nnz | fp | bp | deterministic | fused | median ms | its floor ms | of its floor | "
            "of the CSR floor | rel. L2 to the CSR image |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in result["iterations"]:
            fmt = r.get("format", "csr")
            if "error" in r:
                lines.append(f"| {fmt} | | {r['fp_requested']} | {r['bp_requested']} | not run: {r['error']} "
                             "| | | | | | |")
                continue
            bp = r["bp"] if r.get("bp_requested", r["bp"]) == r["bp"] else f"{r['bp']} ({r['bp_requested']})"
            lines.append(
                f"| {fmt} | {_fmt(r.get('bytes_per_nnz'), '.2f')} | {r['fp']} | {bp} | "
                f"{'yes' if r['deterministic'] else 'no'} | {', '.join(r.get('fused') or []) or '-'} | "
                f"{r['median_s'] * 1e3:.3f} | {r['floor_s'] * 1e3:.3f} | {_fmt(r['of_floor'], '.1%')} | "
                f"{_fmt(r.get('of_csr_floor'), '.1%')} | {_fmt(r.get('rel_l2_to_csr'), '.1e')} |"
            )
        lines += [
            "",
            "Its floor: the bytes of the matrices one iteration reads (A once for a one pass, A and A^T for a "
            "pair, A twice without A^T) at the copy bandwidth; the CSR floor: A and A^T as CSR. Images compared "
            "after 3 iterations from the same start with the float32 CSR pair's (csr_vector).",
            "",
        ]
        pick = auto_versus_fastest(result["iterations"])
        if pick:
            lines += [pick, ""]
    return "\n".join(lines)


#: The columns of ``spmv.csv``: ``lanes`` per row and the launch ``shape`` (``256t``, ``1024t row1024 mb2``;
#: empty where the kernel has none), ``auto``: whether ``auto`` runs this kernel for this operation.
CSV_FIELDS = ("op", "kernel", "lanes", "shape", "secsize", "auto", "deterministic", "median_s", "min_s", "bytes",
              "bandwidth", "of_copy", "vs_cusparse", "rel_l2")


def format_csv(result: dict[str, Any]) -> str:
    """One CSV row per kernel and operation (the workflow's ``spmv.csv``; kernels not run are left out)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in result["kernels"]:
        if "median_s" in r:
            w.writerow({k: r.get(k) for k in CSV_FIELDS})
    return buf.getvalue()


def write_results(result: dict[str, Any], *, out_json=None, out_md=None, out_csv=None) -> None:
    """Write the report files that are asked for, each atomically."""
    from mlemlib._io import atomic_path

    for path, text in (
        (out_json, lambda: json.dumps(result, indent=2, default=_json_default) + "\n"),
        (out_md, lambda: format_markdown(result) + "\n"),
        (out_csv, lambda: format_csv(result)),
    ):
        if path is None:
            continue
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            Path(tmp).write_text(text(), encoding="utf-8")


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
