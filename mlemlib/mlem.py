"""The MLEM iteration, independent of the backend; checkpoints, timings, accuracy (all backends).

:func:`reconstruct` loads a problem (system matrix ``A``, measurement ``g``,
norm, optionally ``A^T``) once, builds a backend with :func:`make_backend`
(``cpu``; ``cuda`` on one GPU; several GPUs through :mod:`mlemlib.dist`),
and runs the numerical contract of DESIGN.md ``repetitions`` times::

    f0 = sum(g) / sum(norm)                  (sums in float64)
    fp = A f ; c = g / fp (0 where fp == 0) ; bp = A^T c ; f <- f * bp / norm (f * bp where norm == 0)

Every iteration's step times are kept; every ``checkpoint_every`` iterations
the image is saved atomically (HDF5, with the iteration and a hash of the
inputs) so that a killed run resumes where it stopped and ends with the same
image, bit for bit, on a deterministic backend. It writes ``image.h5`` (grid
shape, voxel size), ``image.raw`` (nCols float32, no header, for the existing
tools) and ``timings.json`` (per-step statistics per repetition, set-up
times, backend and device facts, accuracy).

:func:`reference` is the same loop in float64 on the CPU: the yardstick every
run of the problem is measured against (``reference.h5``).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import math
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mlemlib import __version__
from mlemlib._io import atomic_path
from mlemlib.backends.base import Backend
from mlemlib.errors import ConfigError, DeviceError, InputError, MatrixFormatError
from mlemlib.matrix import CSRMatrix
from mlemlib.timing import StepTimes, Stopwatch, format_seconds

log = logging.getLogger(__name__)

IMAGE_FORMAT = "mlem-image"
CHECKPOINT_FORMAT = "mlem-checkpoint"
TIMINGS_FORMAT = "mlem-timings"
FORMAT_VERSION = 1

#: Column order of images (see :mod:`mlemlib.phantom`).
COLUMN_ORDER = "col = x + gridX*(y + gridY*z); image array shape (gridZ, gridY, gridX), C order"


# --------------------------------------------------------------------------- matrix sources
class InMemorySource:
    """A :class:`~mlemlib.matrix.CSRMatrix` with the file readers' interface (``read_rows``, ``iter_chunks``).

    Parameters
    ----------
    matrix
        The matrix.
    grid, voxel_size
        Optional geometry (``(gridX, gridY, gridZ)``, ``(w, h, d)`` mm).
    source
        Name used in messages.
    """

    def __init__(
        self,
        matrix: CSRMatrix,
        *,
        grid: tuple[int, int, int] | None = None,
        voxel_size: tuple[float, float, float] | None = None,
        source: str = "<memory>",
    ) -> None:
        self.matrix = matrix
        self.shape = matrix.shape
        self.nnz = matrix.nnz
        self.grid = tuple(grid) if grid is not None else None
        self.voxel_size = tuple(voxel_size) if voxel_size is not None else None
        self.source = source
        self.attrs: dict[str, Any] = {}

    def read_indptr(self) -> np.ndarray:
        return self.matrix.indptr

    def read_rows(self, start: int, stop: int, *, validate: bool = True) -> CSRMatrix:
        if start == 0 and stop == self.shape[0]:
            return self.matrix
        ip = self.matrix.indptr
        lo, hi = int(ip[start]), int(ip[stop])
        return CSRMatrix(ip[start : stop + 1] - lo, self.matrix.indices[lo:hi], self.matrix.data[lo:hi], (stop - start, self.shape[1]))

    def iter_chunks(self, max_nnz: int = 1 << 26, **_: Any):
        m = self.shape[0]
        ip = self.matrix.indptr
        r0 = 0
        while r0 < m:
            target = int(ip[r0]) + max(1, int(max_nnz))
            r1 = int(np.searchsorted(ip, target, side="right")) - 1
            r1 = min(max(r1, r0 + 1), m)
            yield r0, r1, self.read_rows(r0, r1)
            r0 = r1


def open_source(matrix: Any, what: str = "matrix") -> Any:
    """An opened matrix: a path through ``mlemlib.formats.open_matrix``, a CSRMatrix wrapped, else as is."""
    if isinstance(matrix, (str, os.PathLike)):
        from mlemlib.formats import open_matrix

        return open_matrix(matrix)
    if isinstance(matrix, CSRMatrix):
        return InMemorySource(matrix, source=f"<{what} in memory>")
    if hasattr(matrix, "tocsr"):
        return InMemorySource(CSRMatrix.from_scipy(matrix), source=f"<{what} in memory>")
    if hasattr(matrix, "shape") and hasattr(matrix, "read_rows"):
        return matrix
    raise ConfigError(what, f"expected a path, a CSRMatrix or an opened matrix, got {type(matrix).__name__}")


def _source_name(src: Any, given: Any) -> str:
    if isinstance(given, (str, os.PathLike)):
        return os.fspath(given)
    return str(getattr(src, "source", None) or getattr(src, "path", None) or "<memory>")


def column_sums(src: Any, *, max_nnz: int = 1 << 24) -> np.ndarray:
    """The norm (column sums of ``A``, float64, in row order), streaming the matrix."""
    from mlemlib.norm import accumulate_column_sums

    sums = np.zeros(int(src.shape[1]), dtype=np.float64)
    for _, _, block in src.iter_chunks(max_nnz=max_nnz):
        accumulate_column_sums(sums, block, source=_source_name(src, None))
    return sums


# --------------------------------------------------------------------------- images
def _attr_value(v: Any) -> Any:
    if isinstance(v, (dict, list, tuple)) and not (
        isinstance(v, (list, tuple)) and v and all(isinstance(x, (int, float, np.integer, np.floating)) for x in v)
    ):
        return json.dumps(v)
    if isinstance(v, Path):
        return os.fspath(v)
    return v


def write_image(
    path: str | os.PathLike,
    image: np.ndarray,
    *,
    grid: tuple[int, int, int] | None = None,
    voxel_size: tuple[float, float, float] | None = None,
    attrs: dict[str, Any] | None = None,
) -> None:
    """Write an image as HDF5, atomically.

    Layout: dataset ``/image`` (float32, or float64 for a reference) of shape
    ``(gridZ, gridY, gridX)`` when ``grid`` is known, else ``(n,)``; attributes
    ``format="mlem-image"``, ``version``, ``column_order``, ``grid``
    (``gridX, gridY, gridZ``), ``voxel_size`` (mm), and ``attrs`` (None values
    skipped, dicts and lists of strings stored as JSON text).
    """
    import h5py

    a = np.asarray(image)
    if a.dtype not in (np.float32, np.float64):
        a = a.astype(np.float32)
    n = a.size
    if grid is not None:
        gx, gy, gz = (int(v) for v in grid)
        if gx * gy * gz != n:
            raise ConfigError("grid", f"grid {gx}x{gy}x{gz} does not hold {n} voxels")
        a = a.reshape(gz, gy, gx)
    else:
        a = a.reshape(-1)
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        f.create_dataset("image", data=a)
        f.attrs["format"] = IMAGE_FORMAT
        f.attrs["version"] = FORMAT_VERSION
        f.attrs["column_order"] = COLUMN_ORDER
        if grid is not None:
            f.attrs["grid"] = np.asarray(grid, dtype=np.int64)
        if voxel_size is not None:
            f.attrs["voxel_size"] = np.asarray(voxel_size, dtype=np.float64)
        for k, v in (attrs or {}).items():
            if v is not None:
                f.attrs[k] = _attr_value(v)


def _plain_attr(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    return v


def read_image(path: str | os.PathLike, expected_length: int | None = None) -> tuple[np.ndarray, dict[str, Any]]:
    """Read an image written by :func:`write_image` (image, truth, reference, checkpoint).

    Returns
    -------
    (numpy.ndarray, dict)
        The flat image (column order, its stored dtype) and its attributes.

    Raises
    ------
    InputError
        Missing or unreadable file, no ``/image`` dataset, wrong length, non-finite values.
    """
    import h5py

    source = os.fspath(path)
    if not os.path.isfile(source):
        raise InputError(source, "no such image file")
    try:
        f = h5py.File(source, "r")
    except OSError as exc:
        raise InputError(source, f"not a readable HDF5 file ({exc})") from None
    with f:
        if "image" not in f or not isinstance(f["image"], h5py.Dataset):
            raise InputError(source, "no dataset /image (expected an image written by mlem)")
        ds = f["image"]
        if ds.dtype.kind != "f":
            raise InputError(source, f"/image has dtype {ds.dtype}, expected float32 or float64")
        img = ds[...].reshape(-1)
        attrs = {k: _plain_attr(v) for k, v in f.attrs.items()}
    if expected_length is not None and img.size != int(expected_length):
        raise InputError(source, f"image has {img.size} voxels, expected {int(expected_length)} (the matrix's columns)")
    if not np.isfinite(img).all():
        raise InputError(source, "image holds non-finite values")
    return img, attrs


def write_raw(path: str | os.PathLike, image: np.ndarray) -> None:
    """Write the image as raw little-endian float32, nCols values, no header (the existing tools' format)."""
    with atomic_path(path) as tmp:
        np.ascontiguousarray(np.asarray(image).reshape(-1), dtype="<f4").tofile(tmp)


# --------------------------------------------------------------------------- fingerprints
def _sha(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()


def matrix_fingerprint(src: Any) -> str:
    """A hash identifying a system matrix without reading all of it.

    Uses the container's ``checksum`` attribute where there is one, plus the
    shape, nnz and a hash of the row pointer; for an in-memory matrix, a hash
    of all three arrays.
    """
    m, n = (int(v) for v in src.shape)
    parts: list[bytes | str] = [f"{m}x{n}:{int(src.nnz)}"]
    attrs = getattr(src, "attrs", None) or {}
    checksum = attrs.get("checksum") or getattr(src, "checksum", None)
    if checksum:
        parts.append(f"checksum:{checksum}")
    if isinstance(src, InMemorySource) and not checksum:
        a = src.matrix
        parts += [np.ascontiguousarray(a.indptr).tobytes(), np.ascontiguousarray(a.indices).tobytes(), np.ascontiguousarray(a.data).tobytes()]
    else:
        if hasattr(src, "read_indptr"):
            parts.append(np.ascontiguousarray(src.read_indptr(), dtype=np.int64).tobytes())
        if not checksum and m:
            # No checksum to trust: sample rows at the start, middle and end.
            for r0 in sorted({0, max(0, m // 2 - 512), max(0, m - 1024)}):
                block = src.read_rows(r0, min(m, r0 + 1024))
                parts += [np.ascontiguousarray(block.indices).tobytes(), np.ascontiguousarray(block.data).tobytes()]
    return _sha(*parts)


def problem_fingerprint(src: Any, g: np.ndarray) -> str:
    """Hash of one MLEM problem: the matrix and the measurement (what a reference is valid for)."""
    return _sha("problem", matrix_fingerprint(src), np.ascontiguousarray(g, dtype=np.int64 if g.dtype.kind in "iu" else np.float64).tobytes())


def _checkpoint_key(problem: str, norm: np.ndarray, dtype: np.dtype) -> str:
    return _sha("checkpoint", problem, np.ascontiguousarray(norm, dtype=np.float64).tobytes(), str(np.dtype(dtype)))


# --------------------------------------------------------------------------- checkpoints
def write_checkpoint(path: str | os.PathLike, image: np.ndarray, *, key: str, repetition: int, iteration: int, state: dict[str, Any]) -> None:
    """Write a checkpoint atomically: ``/image`` plus the iteration, repetition, input hash and loop state."""
    import h5py

    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        f.create_dataset("image", data=np.asarray(image).reshape(-1))
        f.attrs["format"] = CHECKPOINT_FORMAT
        f.attrs["version"] = FORMAT_VERSION
        f.attrs["key"] = key
        f.attrs["repetition"] = int(repetition)
        f.attrs["iteration"] = int(iteration)
        f.attrs["state"] = json.dumps(_finite(state), default=_json_default)
        f.attrs["created"] = _now()


def read_checkpoint(path: str | os.PathLike, *, key: str, n: int, dtype: np.dtype) -> dict[str, Any]:
    """Load a checkpoint and check that it belongs to this problem.

    Returns
    -------
    dict
        ``image``, ``repetition``, ``iteration``, ``state``.

    Raises
    ------
    ConfigError
        The checkpoint belongs to another problem (other matrix, measurement,
        norm or precision), or is not a checkpoint.
    """
    import h5py

    source = os.fspath(path)
    try:
        f = h5py.File(source, "r")
    except OSError as exc:
        raise ConfigError(source, f"not a readable checkpoint ({exc}); delete it to start afresh") from None
    with f:
        fmt = _plain_attr(f.attrs.get("format", ""))
        if fmt != CHECKPOINT_FORMAT or "image" not in f:
            raise ConfigError(source, f"not an mlem checkpoint (format {fmt!r}); delete it or choose another --checkpoint")
        found = _plain_attr(f.attrs.get("key", ""))
        if found != key:
            raise ConfigError(
                source,
                f"checkpoint of another problem (inputs hash {found[:12]}..., this run {key[:12]}...: "
                "matrix, measurement, norm or precision differ); delete it to start afresh",
            )
        img = f["image"][...]
        if img.size != n or img.dtype != np.dtype(dtype):
            raise ConfigError(source, f"checkpoint image is {img.dtype}[{img.size}], expected {np.dtype(dtype)}[{n}]")
        return {
            "image": img,
            "repetition": int(f.attrs["repetition"]),
            "iteration": int(f.attrs["iteration"]),
            "state": json.loads(_plain_attr(f.attrs["state"])),
        }


# --------------------------------------------------------------------------- backend factory
def make_backend(
    name: str,
    matrix: Any,
    g: np.ndarray,
    norm: np.ndarray,
    transpose: Any | None = None,
    *,
    fp: str = "auto",
    bp: str = "auto",
    dtype: Any = np.float32,
    gpus: int = 1,
    layout: str = "local",
    plan: Any | None = None,
    secsize: int | None = None,
    threads: int | None = None,
    **options: Any,
) -> Backend:
    """Build the backend that runs one problem.

    Parameters
    ----------
    name
        ``auto`` (``cuda`` where CuPy sees a GPU, else ``cpu``; ``$MLEM_BACKEND`` overrides), ``cpu`` or ``cuda``.
    matrix
        ``A``: an opened matrix (``read_rows``, ``iter_chunks``, ``shape``) or a CSRMatrix.
    g
        Measurement (length m).
    norm
        Column sums of ``A`` (float64, length n).
    transpose
        ``A^T`` (opened matrix or CSRMatrix, shape (n, m)), or None: back-project with ``A``.
    fp, bp
        Kernel names of the backend (``auto`` lets it choose).
    dtype
        float32, or float64 (cpu only: the reference).
    gpus, layout, plan
        GPU count; multi-GPU layout (``local``: one all-reduce of the image,
        ``thesis``: all-reduce after both projections); the partition plan
        (a ``plan.json`` path or directory) for ``gpus > 1``.
    secsize
        Section size of the merge-based kernel (cuda).
    threads
        Host threads (cpu).
    options
        Further backend-specific keyword arguments.

    Returns
    -------
    Backend
        ``mlemlib.backends.cpu.CpuBackend``; for ``cuda`` with one GPU
        ``mlemlib.backends.cuda.CudaBackend(matrix, g, norm, transpose=, fp=, bp=[, secsize=])``
        (or that module's ``make_backend``), with several GPUs
        ``mlemlib.dist.make_backend(matrix, g, norm, transpose=, fp=, bp=, gpus=, layout=, plan=[, secsize=])``
        (or ``mlemlib.dist.nccl.make_backend``); all imported lazily.

    Raises
    ------
    ConfigError
        Unknown backend, or settings the backend cannot honour.
    DeviceError
        CUDA requested but CuPy or the CUDA backend is not available.
    """
    from mlemlib.backends import get_backend_name

    resolved = get_backend_name(name)
    gpus = 1 if gpus is None else int(gpus)
    if gpus < 1:
        raise ConfigError("gpus", f"must be >= 1, got {gpus}")
    if layout not in (None, "local", "thesis"):
        raise ConfigError("layout", f"unknown layout {layout!r}, expected local or thesis")
    if resolved == "cpu":
        if gpus != 1:
            raise ConfigError("gpus", f"the cpu backend runs on the host: --gpus {gpus} needs --backend cuda")
        from mlemlib.backends.cpu import CpuBackend

        return CpuBackend(matrix, g, norm, transpose=transpose, fp=fp, bp=bp, dtype=dtype, threads=threads, **options)
    if np.dtype(dtype) != np.float32:
        raise ConfigError("dtype", "the cuda backend computes in float32; the float64 reference runs on the cpu")
    kw: dict[str, Any] = {"transpose": transpose, "fp": fp, "bp": bp, **options}
    if secsize is not None:
        kw["secsize"] = secsize
    try:
        if gpus == 1 and not options.get("graph"):
            from mlemlib.backends.cuda import CudaBackend as factory
        else:  # several GPUs, or graph capture (the NCCL backend's, on one GPU too)
            from mlemlib.dist import make_backend as factory

            kw.update(gpus=gpus, layout=layout or "local", plan=plan)
    except ImportError as exc:
        raise DeviceError(f"backend cuda with {gpus} GPU(s) is not available: {exc}") from exc
    return factory(matrix, g, norm, **kw)


# --------------------------------------------------------------------------- the loop
def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def _log_interval(iterations: int) -> int:
    """Log every iteration of a short run, about 20 lines for a long one."""
    return 1 if iterations <= 20 else max(1, iterations // 20)


def _matrix_label(path: Any) -> str | None:
    """``results/{matrix}/matrix.h5`` -> ``{matrix}``; other files: their stem."""
    if not isinstance(path, (str, os.PathLike)):
        return None
    p = Path(path)
    if p.stem in ("matrix", "transpose") and p.resolve().parent.name:
        return p.resolve().parent.name
    return p.name.split(".")[0]


def _load_truth(truth: Any, n: int) -> tuple[np.ndarray | None, Any]:
    if truth is None:
        return None, None
    if isinstance(truth, np.ndarray):
        t = truth.reshape(-1)
        if t.size != n:
            raise ConfigError("truth", f"truth has {t.size} voxels, expected n = {n}")
        return t, None
    from mlemlib.phantom import load_regions

    t, attrs = read_image(truth, expected_length=n)
    grid = attrs.get("grid")
    vs = attrs.get("voxel_size")
    try:
        regions = load_regions(attrs, grid, vs)
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("%s: regions attribute unreadable (%s); no contrast recovery", truth, exc)
        regions = None
    return t, regions


def _load_reference(reference: Any, n: int, problem: str, iterations: int) -> np.ndarray | None:
    if reference is None:
        return None
    if isinstance(reference, np.ndarray):
        r = reference.reshape(-1)
        if r.size != n:
            raise ConfigError("reference", f"reference has {r.size} voxels, expected n = {n}")
        return r
    r, attrs = read_image(reference, expected_length=n)
    found = attrs.get("problem")
    if found is not None and found != problem:
        raise ConfigError(
            os.fspath(reference), "reference of another problem (matrix or measurement differ); recompute it with --reference-mode"
        )
    it = attrs.get("iterations")
    if it is not None and int(it) != int(iterations):
        raise ConfigError(os.fspath(reference), f"reference after {int(it)} iterations, this run does {iterations}")
    return r


def _close_all(objs: list[Any]) -> None:
    for o in objs:
        close = getattr(o, "close", None)
        if callable(close):
            try:
                close()
            except OSError as exc:  # pragma: no cover - a failing close of a read-only file
                log.warning("closing %r: %s", o, exc)


def reconstruct(
    matrix: Any,
    sino: Any,
    out_image: str | os.PathLike,
    *,
    iterations: int,
    backend: str = "auto",
    fp: str = "auto",
    bp: str = "auto",
    secsize: int | None = None,
    graph: bool = False,
    gpus: int = 1,
    layout: str = "local",
    norm: Any | None = None,
    transpose: Any | None = None,
    plan: Any | None = None,
    checkpoint_every: int = 10,
    checkpoint: str | os.PathLike | None = None,
    repetitions: int = 1,
    reference: Any | None = None,
    truth: Any | None = None,
    timings_out: str | os.PathLike | None = None,
    raw_out: str | os.PathLike | None | bool = None,
    reference_mode: bool = False,
    threads: int | None = None,
    device_info: dict[str, Any] | None = None,
    matrix_name: str | None = None,
    keep_checkpoint: bool = False,
    progress: Callable[[int, int, Any], None] | None = None,
) -> dict[str, Any]:
    """Reconstruct an image with MLEM; write ``image.h5``, ``image.raw`` and ``timings.json``.

    Parameters
    ----------
    matrix
        System matrix: a path (``.h5``, ``.csr4``, ``.mtx``, ``.npz``), an opened matrix or a CSRMatrix.
    sino
        Measurement: a ``.LMsino`` path or an array of m counts.
    out_image
        The ``image.h5`` to write.
    iterations
        MLEM iterations per repetition (>= 0).
    backend, fp, bp, secsize, graph, gpus, layout, plan, threads
        Passed to :func:`make_backend`.
    norm
        ``norm.h5`` path or array (float64, n); None computes the column sums.
    transpose
        ``transpose.h5`` path, opened matrix or CSRMatrix of ``A^T``; None back-projects with ``A``.
    checkpoint_every
        Save the image every K iterations (0: never).
    checkpoint
        Checkpoint file (default: ``<out_image stem>.checkpoint.h5`` beside the
        image). Where it exists, the run resumes from it; it is removed once the
        outputs are written (unless ``keep_checkpoint``).
    repetitions
        Times the reconstruction is repeated (the matrix is loaded once); each
        repetition is timed and measured separately.
    reference
        ``reference.h5`` (or an array): the float64 MLEM of the same problem
        and iteration count, for the relative L2 error.
    truth
        ``truth.h5`` (or an array) of a simulated phantom.
    timings_out
        ``timings.json`` path (default: ``timings.json`` beside the image).
    raw_out
        ``image.raw`` path (default: the image's path with suffix ``.raw``;
        False: none).
    reference_mode
        Compute the float64 reference instead (cpu, float64; ``fp``/``bp``
        ``auto`` become ``scipy``); see :func:`reference`.
    device_info
        Facts about the device(s) recorded in ``timings.json``.
    matrix_name
        Name of the matrix in tables (default: from its path).
    progress
        Called as ``progress(repetition, iteration, image)`` after every
        iteration (and after its checkpoint), e.g. for a progress bar.

    Returns
    -------
    dict
        The content of ``timings.json``.
    """
    opened: list[Any] = []
    try:
        return _reconstruct(
            opened, matrix, sino, out_image, iterations=iterations, backend=backend, fp=fp, bp=bp, secsize=secsize,
            graph=graph, gpus=gpus, layout=layout, norm=norm, transpose=transpose, plan=plan, checkpoint_every=checkpoint_every,
            checkpoint=checkpoint, repetitions=repetitions, reference=reference, truth=truth, timings_out=timings_out,
            raw_out=raw_out, reference_mode=reference_mode, threads=threads, device_info=device_info,
            matrix_name=matrix_name, keep_checkpoint=keep_checkpoint, progress=progress,
        )
    finally:
        _close_all(opened)


def _reconstruct(opened: list[Any], matrix: Any, sino: Any, out_image: Any, *, iterations: int, backend: str, fp: str,
                 bp: str, secsize: int | None, graph: bool, gpus: int, layout: str, norm: Any, transpose: Any, plan: Any,
                 checkpoint_every: int, checkpoint: Any, repetitions: int, reference: Any, truth: Any,
                 timings_out: Any, raw_out: Any, reference_mode: bool, threads: int | None,
                 device_info: dict[str, Any] | None, matrix_name: str | None, keep_checkpoint: bool,
                 progress: Callable[[int, int, Any], None] | None) -> dict[str, Any]:
    """The body of :func:`reconstruct`; files it opens are appended to ``opened`` (closed by the caller)."""
    from mlemlib import metrics
    from mlemlib.formats.lmsino import read_lmsino
    from mlemlib.phantom import matrix_geometry

    iterations = _check_int("iterations", iterations, 0)
    repetitions = _check_int("repetitions", repetitions, 1)
    checkpoint_every = _check_int("checkpoint_every", checkpoint_every or 0, 0)
    out_image = Path(out_image)
    if reference_mode:
        backend, dtype = "cpu", np.dtype(np.float64)
        fp = "scipy" if fp in (None, "auto") else fp
        bp = "scipy" if bp in (None, "auto") else bp
        if gpus not in (None, 1):
            raise ConfigError("gpus", "the reference runs on the cpu (gpus 1)")
    else:
        dtype = np.dtype(np.float32)

    # ---- load ---------------------------------------------------------------
    with Stopwatch() as sw_load:
        src = open_source(matrix, "matrix")
        if src is not matrix:
            opened.append(src)
        m, n = (int(v) for v in src.shape)
        if isinstance(sino, (str, os.PathLike)):
            g = read_lmsino(sino, expected_length=m)
        else:
            g = np.asarray(sino).reshape(-1)
            if g.size != m:
                raise ConfigError("sino", f"measurement has {g.size} values, the matrix has m = {m} rows")
        if norm is None:
            log.info("no norm given: computing the column sums of the matrix")
            norm_arr = column_sums(src)
        elif isinstance(norm, (str, os.PathLike)):
            from mlemlib.norm import read_norm

            norm_arr = read_norm(norm, expected_length=n)
        else:
            norm_arr = np.asarray(norm, dtype=np.float64).reshape(-1)
            if norm_arr.size != n:
                raise ConfigError("norm", f"norm has {norm_arr.size} values, the matrix has n = {n} columns")
        tsrc = None
        if transpose is not None:
            tsrc = open_source(transpose, "transpose")
            if tsrc is not transpose:
                opened.append(tsrc)
            if tuple(int(v) for v in tsrc.shape) != (n, m):
                raise MatrixFormatError(
                    _source_name(tsrc, transpose), f"transpose has shape {tuple(tsrc.shape)}, expected (n, m) = {(n, m)}"
                )
        problem = problem_fingerprint(src, g)
        key = _checkpoint_key(problem, norm_arr, dtype)
        ref_img = _load_reference(reference, n, problem, iterations)
        truth_img, regions = _load_truth(truth, n)
    grid, voxel_size = matrix_geometry(src)
    log.info("loaded problem %s: %d x %d, %d nnz (%.2f s)", problem[:12], m, n, int(src.nnz), sw_load.seconds)

    # ---- resume (checked before the backend is built: a refused checkpoint costs no set-up) ----
    ckpt_path = Path(checkpoint) if checkpoint is not None else out_image.with_name(out_image.stem + ".checkpoint.h5")
    records: list[dict[str, Any]] = []
    start_rep, start_it, resume_image, resume_samples, resumed_at = 0, 0, None, None, None
    ck_config = None
    if ckpt_path.exists() and (checkpoint_every > 0 or checkpoint is not None):
        ck = read_checkpoint(ckpt_path, key=key, n=n, dtype=dtype)
        if ck["repetition"] >= repetitions or ck["iteration"] > iterations:
            raise ConfigError(
                os.fspath(ckpt_path),
                f"checkpoint at repetition {ck['repetition'] + 1}, iteration {ck['iteration']} is beyond this run "
                f"({repetitions} repetitions of {iterations} iterations); delete it to start afresh",
            )
        ck_config = ck["state"].get("config", {})
        records = ck["state"].get("records", [])
        start_rep, start_it = ck["repetition"], ck["iteration"]
        resume_image = ck["image"]
        resume_samples = ck["state"].get("samples", {})
        resumed_at = ck["state"].get("resumed_at", []) + [start_it]
        log.info("resuming from %s: repetition %d, iteration %d", ckpt_path, start_rep + 1, start_it)

    # ---- backend --------------------------------------------------------------
    with Stopwatch() as sw_setup:
        be = make_backend(
            backend, src, g, norm_arr, tsrc, fp=fp, bp=bp, dtype=dtype, gpus=gpus, layout=layout, plan=plan,
            secsize=secsize, threads=threads, **({"graph": True} if graph else {}),
        )
    desc = be.describe()
    # Under a launcher (one process per GPU) every rank holds the same image; rank 0 writes.
    writer = bool(getattr(be, "writes_output", True))
    log.info("backend %s ready (%.2f s): %s", desc.get("backend", backend), sw_setup.seconds, desc)

    config = {
        "backend": desc.get("backend", backend), "fp": desc.get("fp", fp), "bp": desc.get("bp", bp),
        "secsize": secsize, "gpus": gpus, "layout": layout, "dtype": str(dtype),
    }
    if graph:
        config["graph"] = True
    if ck_config is not None and ck_config != config:
        log.warning("%s: written by another configuration %s; resuming with %s", ckpt_path, ck_config, config)

    # ---- iterate --------------------------------------------------------------
    every = _log_interval(iterations)
    host_img = None
    for rep in range(start_rep, repetitions):
        times = StepTimes()
        if rep == start_rep and resume_image is not None:
            f = be.from_host(resume_image)
            first = start_it + 1
            for step, vals in (resume_samples or {}).items():
                for v in vals:
                    times.samples.setdefault(step, []).append(float(v))
            rep_resumed = resumed_at
        else:
            f = be.initial_image()
            first = 1
            rep_resumed = []
        t_rep = time.perf_counter()
        t_log = t_rep
        ckpt_s = 0.0
        for it in range(first, iterations + 1):
            t0 = time.perf_counter()
            f = be.iterate(f)
            step_times = dict(be.last_step_times())
            wall = time.perf_counter() - t0
            step_times.setdefault("iteration", wall)
            times.add(step_times)
            now = time.perf_counter()
            if it % every == 0 or it == iterations or now - t_log >= 30.0:
                t_log = now
                mean = times.mean("iteration")
                left = (iterations - it) * mean + (repetitions - rep - 1) * iterations * mean
                parts = ", ".join(f"{k} {format_seconds(v)}" for k, v in step_times.items() if k != "iteration")
                log.info(
                    "repetition %d/%d iteration %d/%d: %s/iteration (%s), ETA %s",
                    rep + 1, repetitions, it, iterations, format_seconds(step_times["iteration"]), parts,
                    format_seconds(left),
                )
            if writer and checkpoint_every and it % checkpoint_every == 0:
                t_ck = time.perf_counter()
                state = {"config": config, "records": records, "samples": times.to_json(), "resumed_at": rep_resumed}
                write_checkpoint(ckpt_path, be.to_host(f), key=key, repetition=rep, iteration=it, state=state)
                ckpt_s += time.perf_counter() - t_ck
            if progress is not None:
                progress(rep, it, f)
        with Stopwatch() as sw_back:
            host_img = be.to_host(f)
        acc = metrics.accuracy(host_img, reference=ref_img, truth=truth_img, regions=regions)
        record = {
            "repetition": rep,
            "iterations": iterations,
            "resumed_at": rep_resumed,
            "wall_s": time.perf_counter() - t_rep,
            "checkpoint_s": ckpt_s,
            "readback_s": sw_back.seconds,
            "steps": times.summary(),
            "samples": times.to_json(),
            "accuracy": acc,
        }
        records.append(record)
        log.info(
            "repetition %d/%d done: mean %s/iteration, image sum %.9g%s",
            rep + 1, repetitions, format_seconds(times.mean("iteration")), acc["image_sum"],
            f", rel. L2 to reference {acc['rel_l2_reference']:.3g}" if "rel_l2_reference" in acc else "",
        )

    # ---- outputs --------------------------------------------------------------
    nnz = int(src.nnz)
    bytes_a = 8 * (m + 1) + 8 * nnz
    used_t = transpose_used(desc.get("transpose"), tsrc is not None)
    bytes_at = 8 * (n + 1) + 8 * nnz if used_t else None
    mname = matrix_name or _matrix_label(matrix) or "matrix"
    timings: dict[str, Any] = {
        "format": TIMINGS_FORMAT,
        "version": FORMAT_VERSION,
        "created": _now(),
        "mlemlib_version": __version__,
        "host": socket.gethostname(),
        "config": {
            "matrix": mname,
            "matrix_path": _source_name(src, matrix),
            "sino": os.fspath(sino) if isinstance(sino, (str, os.PathLike)) else "<memory>",
            "data": Path(sino).name.split(".")[0] if isinstance(sino, (str, os.PathLike)) else "memory",
            "norm": os.fspath(norm) if isinstance(norm, (str, os.PathLike)) else None,
            "transpose": os.fspath(transpose) if isinstance(transpose, (str, os.PathLike)) else (None if transpose is None else "<memory>"),
            "reference": os.fspath(reference) if isinstance(reference, (str, os.PathLike)) else None,
            "truth": os.fspath(truth) if isinstance(truth, (str, os.PathLike)) else None,
            "plan": os.fspath(plan) if isinstance(plan, (str, os.PathLike)) else None,
            "backend": config["backend"],
            "fp": config["fp"],
            "bp": config["bp"],
            "fp_requested": fp,
            "bp_requested": bp,
            "secsize": secsize,
            "gpus": gpus,
            "layout": layout,
            "graph": bool(graph),
            "iterations": iterations,
            "repetitions": repetitions,
            "checkpoint_every": checkpoint_every,
            "dtype": str(dtype),
            "reference_mode": bool(reference_mode),
        },
        "problem": problem,
        "shape": [m, n],
        "nnz": nnz,
        "grid": list(grid) if grid else None,
        "voxel_size": list(voxel_size) if voxel_size else None,
        "backend": desc,
        "deterministic": bool(desc.get("deterministic", be.deterministic)),
        "device": device_info if device_info is not None else desc.get("device"),
        "bytes": {
            "A": bytes_a,
            "AT": bytes_at,
            "fp": bytes_a,
            "bp": bytes_at if used_t else bytes_a,
            "iteration": bytes_a + (bytes_at if used_t else bytes_a),
        },
        "setup": {"load_s": sw_load.seconds, "backend_s": sw_setup.seconds},
        "repetitions": records,
    }
    attrs = {
        "iterations": iterations,
        "repetitions": repetitions,
        "backend": config["backend"],
        "fp": config["fp"],
        "bp": config["bp"],
        "gpus": gpus,
        "layout": layout,
        "dtype": str(dtype),
        "problem": problem,
        "reference": bool(reference_mode),
        "deterministic": timings["deterministic"],
        "matrix": timings["config"]["matrix_path"],
        "sino": timings["config"]["sino"],
        "image_sum": metrics.image_sum(host_img),
        "created": timings["created"],
    }
    raw_path = None
    if raw_out is not False and not (raw_out is None and reference_mode):
        raw_path = out_image.with_suffix(".raw") if raw_out in (None, True) else Path(raw_out)
    tpath = None
    if timings_out is not False and not (timings_out is None and reference_mode):
        tpath = Path(timings_out) if timings_out not in (None, True) else out_image.with_name("timings.json")
    timings["outputs"] = {
        "image": os.fspath(out_image),
        "raw": os.fspath(raw_path) if raw_path else None,
        "timings": os.fspath(tpath) if tpath else None,
    }
    if not writer:
        log.info("not the writing rank: leaving %s to rank 0", out_image)
        return timings
    write_image(out_image, host_img, grid=grid, voxel_size=voxel_size, attrs=attrs)
    if raw_path is not None:
        write_raw(raw_path, host_img)
    if tpath is not None:
        with atomic_path(tpath) as tmp:
            tmp.write_text(json.dumps(_finite(timings), indent=1, default=_json_default, allow_nan=False) + "\n")
    if ckpt_path.exists() and not keep_checkpoint and (checkpoint_every > 0 or checkpoint is not None):
        ckpt_path.unlink()
    log.info("wrote %s", out_image)
    return timings


def reference(
    matrix: Any,
    sino: Any,
    out: str | os.PathLike,
    *,
    iterations: int,
    norm: Any | None = None,
    transpose: Any | None = None,
    truth: Any | None = None,
    timings_out: str | os.PathLike | None = None,
    record_out: str | os.PathLike | None = None,
    fp: str = "auto",
    bp: str = "auto",
    checkpoint_every: int = 0,
    checkpoint: str | os.PathLike | None = None,
    threads: int | None = None,
) -> dict[str, Any]:
    """The float64 reference MLEM of a problem, written to ``reference.h5``.

    The same loop as :func:`reconstruct` on the cpu backend in float64
    (SciPy kernels by default; ``fp="numba", bp="numba"`` avoid SciPy's float64
    copy of the matrix for big problems). The image file records the problem
    hash and the iteration count, which :func:`reconstruct` checks before
    comparing against it. ``timings_out`` (alias ``record_out``) also writes
    its ``timings.json``.
    """
    return reconstruct(
        matrix, sino, out, iterations=iterations, norm=norm, transpose=transpose, truth=truth,
        timings_out=timings_out if timings_out is not None else record_out, raw_out=False, reference_mode=True,
        fp=fp, bp=bp, checkpoint_every=checkpoint_every, checkpoint=checkpoint, threads=threads,
    )


#: Alias used by the workflow's ``reference_mlem`` rule.
reference_mlem = reference


def transpose_used(value: Any, default: bool) -> bool:
    """Whether the back projection reads ``A^T``, from a backend's ``describe()["transpose"]``.

    Backends say True/False, or a word: ``"none"`` (back projection with ``A``),
    ``"stored"`` or ``"cusparse on device"`` (a transpose on the device).
    """
    if value is None:
        return default
    if isinstance(value, str):
        return value.strip().lower() not in ("", "none", "no", "false")
    return bool(value)


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < minimum:
        raise ConfigError(name, f"must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _finite(o: Any) -> Any:
    """A copy of nested dicts/lists with NaN and infinities replaced by None (strict JSON)."""
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    if isinstance(o, (float, np.floating)):
        return float(o) if math.isfinite(o) else None
    return o


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return os.fspath(o)
    if isinstance(o, float) and not math.isfinite(o):
        return None
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
