"""The MLEM iteration, independent of the backend; checkpoints, timings, accuracy (all backends).

:func:`reconstruct` loads a problem (system matrix ``A``, measurement ``g``,
norm, optionally ``A^T``) once, builds a backend with :func:`make_backend`
(:func:`mlemlib.backends.make_backend`: ``cpu``, ``cuda`` on one or several GPUs),
and runs the numerical contract of DESIGN.md ``repetitions`` times::

    f0 = sum(g) / sum(norm)                  (sums in float64)
    fp = A f ; c = g / fp (0 where fp == 0) ; bp = A^T c ; f <- f * bp / norm (f * bp where norm == 0)

Every iteration's step times are kept; every ``checkpoint_every`` iterations
the image is saved atomically (HDF5, with the iteration and a hash of the
inputs) so that a killed run resumes where it stopped and ends with the same
image, bit for bit, on a deterministic backend. It writes ``image.h5`` (grid
shape, voxel size), ``image.raw`` (nCols float32, no header, for the existing
tools) and ``timings.json`` (per-step statistics per repetition, set-up
times, backend and device facts, accuracy). On GPUs it also records each
GPU's measured copy bandwidth once per run (in the backend's device facts)
and each repetition's energy from NVML (:class:`mlemlib.devices.EnergyMeter`):
``energy_J``, ``energy_per_iteration_J``, ``power_W``, None where not
available (the CPU, no ``pynvml``, a GPU without the counter).

A reordered matrix (``mlem reorder``, :mod:`mlemlib.reorder`) is run in its
permuted space and transparently so: the measurement is read in the user's
LOR order and permuted (``g' = g[rows]``) before the problem is fingerprinted,
the iterated images (and checkpoints) are in the permuted voxel order, and the
image is mapped back to the user's voxel order before it is measured against
the reference and truth (both in the user's order) and written. A folded
matrix (:mod:`mlemlib.fold`: each distinct row stored once) is as
transparent: the measurement is read in the user's LOR order and folded
(each stored row gets the sum of its LORs' counts) before the permutation,
and its norm counts each stored row as often as it occurs.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlemlib import __version__
from mlemlib._io import atomic_path
from mlemlib.backends import make_backend
from mlemlib.backends.base import Backend, timed_iterations
from mlemlib.devices import EnergyMeter, backend_gpus, capped_between, energy_record
from mlemlib.errors import ConfigError, DeviceError, InputError, MatrixFormatError
from mlemlib.formats import InMemoryMatrix, open_source
from mlemlib.image import FORMAT_VERSION, attr_value, plain_attr, read_image, write_image, write_raw
from mlemlib.fold import fold_of
from mlemlib.norm import source_column_sums
from mlemlib.matrix import CSRMatrix
from mlemlib.reorder import (
    Permutation,
    image_to_permuted_order,
    image_to_user_order,
    permutation_of,
    to_permuted_measurement,
)
from mlemlib.timing import StepTimes, Stopwatch, format_seconds

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "mlem-checkpoint"
TIMINGS_FORMAT = "mlem-timings"


def _source_name(src: Any, given: Any) -> str:
    if isinstance(given, (str, os.PathLike)):
        return os.fspath(given)
    return str(getattr(src, "source", None) or getattr(src, "path", None) or "<memory>")


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
    if isinstance(src, InMemoryMatrix) and not checksum:
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
        fmt = plain_attr(f.attrs.get("format", ""))
        if fmt != CHECKPOINT_FORMAT or "image" not in f:
            raise ConfigError(source, f"not an mlem checkpoint (format {fmt!r}); delete it or choose another --checkpoint")
        found = plain_attr(f.attrs.get("key", ""))
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
            "state": json.loads(plain_attr(f.attrs["state"])),
        }


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
    chunks: Any | None = None,
) -> dict[str, Any]:
    """Reconstruct an image with MLEM; write ``image.h5``, ``image.raw`` and ``timings.json``.

    Parameters
    ----------
    matrix
        System matrix: a path (``.h5``, ``.csr4``, ``.mtx``, ``.npz``), an opened matrix or a CSRMatrix.
        A reordered container (``mlem reorder``) is reconstructed in its
        permuted space, transparently: ``sino``, ``reference``, ``truth`` and
        a norm given as an array are in the user's order, the image written
        is in the user's voxel order (see :mod:`mlemlib.reorder`).
    sino
        Measurement: a ``.LMsino`` path or an array of m counts, in the user's LOR order.
    out_image
        The ``image.h5`` to write.
    iterations
        MLEM iterations per repetition (>= 0).
    backend, fp, bp, secsize, graph, gpus, layout, plan, threads, chunks
        Passed to :func:`make_backend` (``chunks``: the matrix's row chunks as
        a layout file of ``mlem chunk``, read by the chunked one pass).
    norm
        ``norm.h5`` path or array (float64, n); None computes the column sums.
        For a reordered matrix a ``norm.h5`` must be that of the reordered
        matrix (``mlem norm`` of it: the permuted voxel order, checked by its
        ``checksum`` attribute), an array is in the user's voxel order.
    transpose
        ``transpose.h5`` path, opened matrix or CSRMatrix of ``A^T``; None back-projects with ``A``.
        For a reordered matrix: the transpose of the reordered matrix.
    checkpoint_every
        Save the image every K iterations (0: never).
    checkpoint
        Checkpoint file (default: ``<out_image stem>.checkpoint.h5`` beside the
        image). Where it exists, the run resumes from it; it is removed once the
        outputs are written (unless ``keep_checkpoint``). For a reordered matrix
        its image is in the permuted voxel order (its key is that of the
        permuted problem).
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
        ``image`` is the backend's device image: for a reordered matrix it is
        in the permuted voxel order (``mlemlib.reorder.image_to_user_order``
        maps it back).

    Returns
    -------
    dict
        The content of ``timings.json``.
    """
    settings = RunSettings(
        iterations=_check_int("iterations", iterations, 0),
        repetitions=_check_int("repetitions", repetitions, 1),
        checkpoint_every=_check_int("checkpoint_every", checkpoint_every or 0, 0),
        backend=backend, fp=fp, bp=bp, secsize=secsize, graph=bool(graph), gpus=gpus, layout=layout, plan=plan,
        threads=threads, reference_mode=bool(reference_mode), dtype=np.dtype(np.float32),
    )
    if reference_mode:
        settings.backend, settings.dtype = "cpu", np.dtype(np.float64)
        settings.fp = "scipy" if fp in (None, "auto") else fp
        settings.bp = "scipy" if bp in (None, "auto") else bp
        if gpus not in (None, 1):
            raise ConfigError("gpus", "the reference runs on the cpu (gpus 1)")
    out_image = Path(out_image)
    ckpt_path = Path(checkpoint) if checkpoint is not None else out_image.with_name(out_image.stem + ".checkpoint.h5")
    checkpointed = settings.checkpoint_every > 0 or checkpoint is not None
    use_checkpoint = checkpointed and ckpt_path.exists()
    opened: list[Any] = []
    try:
        prob = _load_problem(opened, matrix, sino, norm, transpose, reference, truth, settings)
        resume = _read_resume(ckpt_path, prob, settings) if use_checkpoint else None
        with Stopwatch() as sw_setup:
            be = make_backend(
                settings.backend, prob.src, prob.g, prob.norm, prob.tsrc, fp=settings.fp, bp=settings.bp,
                dtype=settings.dtype, gpus=settings.gpus, layout=settings.layout, plan=settings.plan,
                secsize=settings.secsize, threads=settings.threads, chunks=chunks,
                **({"graph": True} if settings.graph else {}),
            )
        desc = be.describe()
        log.info("backend %s ready (%.2f s): %s", desc.get("backend", settings.backend), sw_setup.seconds, desc)
        gpus_used = backend_gpus(desc)
        if gpus_used:  # once per run, after the set-up's timing: each GPU's copy bandwidth, the yardstick
            from mlemlib.bench import record_copy_bandwidths

            record_copy_bandwidths(gpus_used)
        energy = EnergyMeter(gpus_used, world=desc.get("gpus") or len(gpus_used))
        opened.append(energy)
        config = {
            "backend": desc.get("backend", settings.backend), "fp": desc.get("fp", settings.fp),
            "bp": desc.get("bp", settings.bp), "secsize": secsize, "gpus": gpus, "layout": layout,
            "dtype": str(settings.dtype),
        }
        if settings.graph:
            config["graph"] = True
        if resume is not None and resume["config"] is not None and resume["config"] != config:
            log.warning("%s: written by another configuration %s; resuming with %s", ckpt_path, resume["config"], config)
        # Under a launcher (one process per GPU) every rank holds the same image; rank 0 writes.
        writer = bool(getattr(be, "writes_output", True))
        records, host_img = _iterate(be, prob, settings, config, resume, ckpt_path if writer else None, progress,
                                     energy)
        timings = _timings(
            prob, settings, desc, be, records, config,
            sources={"matrix": matrix, "sino": sino, "norm": norm, "transpose": transpose, "reference": reference,
                     "truth": truth, "plan": plan},
            matrix_name=matrix_name, device_info=device_info, setup_s=sw_setup.seconds,
        )
        return _write_outputs(
            out_image, host_img, timings, prob, writer=writer, raw_out=raw_out, timings_out=timings_out,
            ckpt_path=ckpt_path if checkpointed else None,
            keep_checkpoint=keep_checkpoint,
        )
    finally:
        _close_all(opened)


@dataclass
class RunSettings:
    """What one :func:`reconstruct` call runs (validated numbers; names resolved by the backend)."""

    iterations: int
    repetitions: int
    checkpoint_every: int
    backend: str
    fp: str
    bp: str
    secsize: int | None
    graph: bool
    gpus: int
    layout: str
    plan: Any
    threads: int | None
    reference_mode: bool
    dtype: np.dtype


@dataclass
class Problem:
    """One loaded MLEM problem: the opened matrices, ``g``, the norm, and what it is measured against."""

    src: Any
    tsrc: Any
    g: np.ndarray
    norm: np.ndarray
    fingerprint: str
    key: str
    reference: np.ndarray | None
    truth: np.ndarray | None
    regions: Any
    grid: Any
    voxel_size: Any
    load_s: float
    #: The permutation of a reordered matrix (None otherwise): ``g``, ``norm`` and
    #: the iterated images are in its permuted order; ``reference``, ``truth`` and
    #: ``regions`` stay in the user's order.
    perm: Permutation | None = None
    #: The row fold of a folded matrix (None otherwise): ``g`` is folded into its stored rows.
    row_fold: Any = None

    @property
    def reorder(self) -> str:
        """The reorder mode of the matrix: ``none``, ``rows`` or ``rows+voxels``."""
        return "none" if self.perm is None else self.perm.mode

    def to_user(self, image: np.ndarray) -> np.ndarray:
        """A host image of the iteration (permuted order) in the user's voxel order."""
        if self.perm is None:
            return image
        return np.ascontiguousarray(image_to_user_order(image, self.perm))

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(int(v) for v in self.src.shape)


# --------------------------------------------------------------------------- the sections of reconstruct
def _load_problem(opened: list[Any], matrix: Any, sino: Any, norm: Any, transpose: Any, reference: Any, truth: Any,
                  settings: RunSettings) -> Problem:
    """Open the matrix (and ``A^T``), read ``g`` and the norm, fingerprint the problem, load reference and truth."""
    from mlemlib.formats.lmsino import read_lmsino
    from mlemlib.formats import matrix_geometry

    with Stopwatch() as sw_load:
        src = open_source(matrix, "matrix")
        if src is not matrix:
            opened.append(src)
        m, n = (int(v) for v in src.shape)
        row_fold = fold_of(src)
        m_user = m if row_fold is None else row_fold.m_user
        if isinstance(sino, (str, os.PathLike)):
            g = read_lmsino(sino, expected_length=m_user)
        else:
            g = np.asarray(sino).reshape(-1)
            if g.size != m_user:
                raise ConfigError("sino", f"measurement has {g.size} values, the matrix has m = {m_user} rows")
        if row_fold is not None:
            # g is in the user's LOR order: each stored row gets its LORs' summed counts.
            g = row_fold.fold(g)
            log.info("%s is folded: %d stored rows hold the %d LORs of the measurement (counts summed)",
                     _source_name(src, matrix), m, m_user)
        perm = permutation_of(src)
        if perm is not None:
            if perm.shape != (m, n):
                raise MatrixFormatError(
                    _source_name(src, matrix), f"permutation of a {perm.m} x {perm.n} matrix, the matrix is {m} x {n}"
                )
            # g is in the user's LOR order; the problem (and its fingerprint) lives in the permuted space.
            g = to_permuted_measurement(g, perm)
            log.info("%s is reordered (%s): measurement and images are mapped between the user's and the "
                     "permuted order", _source_name(src, matrix), perm.mode)
        if norm is None:
            log.info("no norm given: computing the column sums of the matrix")
            norm_arr = source_column_sums(src)  # of the permuted matrix: in the permuted order
        elif isinstance(norm, (str, os.PathLike)):
            from mlemlib.norm import read_norm

            if perm is None:
                norm_arr = read_norm(norm, expected_length=n)
            else:
                norm_arr = _read_permuted_norm(norm, n, src, perm, _source_name(src, matrix))
        else:
            norm_arr = np.asarray(norm, dtype=np.float64).reshape(-1)
            if norm_arr.size != n:
                raise ConfigError("norm", f"norm has {norm_arr.size} values, the matrix has n = {n} columns")
            if perm is not None:  # an array is in the user's voxel order
                norm_arr = np.ascontiguousarray(image_to_permuted_order(norm_arr, perm))
        tsrc = None
        if transpose is not None:
            tsrc = open_source(transpose, "transpose")
            if tsrc is not transpose:
                opened.append(tsrc)
            if tuple(int(v) for v in tsrc.shape) != (n, m):
                raise MatrixFormatError(
                    _source_name(tsrc, transpose), f"transpose has shape {tuple(tsrc.shape)}, expected (n, m) = {(n, m)}"
                )
            t_source = (getattr(tsrc, "attrs", None) or {}).get("source_checksum")
            if perm is not None and t_source and t_source == perm.source_checksum:
                raise MatrixFormatError(
                    _source_name(tsrc, transpose),
                    f"transpose of the un-reordered matrix, but {_source_name(src, matrix)} is reordered "
                    f"({perm.mode}); transpose the reordered matrix ('mlem transpose')",
                )
        problem = problem_fingerprint(src, g)
        key = _checkpoint_key(problem, norm_arr, settings.dtype)
        ref_img = _load_reference(reference, n, problem, settings.iterations)
        truth_img, regions = _load_truth(truth, n)
    grid, voxel_size = matrix_geometry(src)
    log.info("loaded problem %s: %d x %d, %d nnz (%.2f s)", problem[:12], m, n, int(src.nnz), sw_load.seconds)
    return Problem(src, tsrc, g, norm_arr, problem, key, ref_img, truth_img, regions, grid, voxel_size, sw_load.seconds,
                   perm, row_fold)


def _read_permuted_norm(path: Any, n: int, src: Any, perm: Permutation, matrix_name: str) -> np.ndarray:
    """The ``norm.h5`` of a reordered matrix: it must be that matrix's own norm (in the permuted voxel order).

    The norm of the user's matrix has the same length but the user's voxel
    order; it is recognised by its ``checksum`` attribute (the user's matrix's)
    and refused in one line naming the file, as is any norm of another matrix.
    """
    from mlemlib.norm import read_norm

    expected = getattr(src, "checksum", None) or (getattr(src, "attrs", None) or {}).get("checksum")
    try:
        return read_norm(path, expected_length=n, expected_checksum=str(expected) if expected else None)
    except MatrixFormatError as exc:
        import h5py

        try:
            with h5py.File(path, "r") as f:
                found = plain_attr(f.attrs.get("checksum", ""))
        except OSError:
            raise exc from None
        if found and found == perm.source_checksum:
            raise MatrixFormatError(
                path,
                f"norm of the un-reordered matrix (in the user's voxel order), but {matrix_name} is reordered "
                f"({perm.mode}); use the norm of the reordered matrix ('mlem norm {matrix_name}')",
            ) from None
        raise


def _read_resume(ckpt_path: Path, prob: Problem, settings: RunSettings) -> dict[str, Any]:
    """The state to resume from (checked before the backend is built: a refused checkpoint costs no set-up)."""
    ck = read_checkpoint(ckpt_path, key=prob.key, n=prob.shape[1], dtype=settings.dtype)
    if ck["repetition"] >= settings.repetitions or ck["iteration"] > settings.iterations:
        raise ConfigError(
            os.fspath(ckpt_path),
            f"checkpoint at repetition {ck['repetition'] + 1}, iteration {ck['iteration']} is beyond this run "
            f"({settings.repetitions} repetitions of {settings.iterations} iterations); delete it to start afresh",
        )
    state = ck["state"]
    log.info("resuming from %s: repetition %d, iteration %d", ckpt_path, ck["repetition"] + 1, ck["iteration"])
    return {
        "config": state.get("config", {}),
        "records": state.get("records", []),
        "repetition": ck["repetition"],
        "iteration": ck["iteration"],
        "image": ck["image"],
        "samples": state.get("samples", {}),
        "resumed_at": state.get("resumed_at", []) + [ck["iteration"]],
    }


def _iterate(be: Backend, prob: Problem, settings: RunSettings, config: dict[str, Any], resume: dict[str, Any] | None,
             ckpt_path: Path | None, progress: Callable[[int, int, Any], None] | None,
             energy: EnergyMeter | None = None) -> tuple[list[dict], np.ndarray]:
    """Run every repetition (from ``resume`` where given); checkpoint (where ``ckpt_path``); return records and image.

    Where ``energy`` is available, each repetition's GPU energy is read
    before and after its iteration loop, the GPUs synchronised first (an
    iteration may still run when ``iterate`` returns), outside the step
    timings; the record gets :func:`mlemlib.devices.energy_record`'s fields
    (None where not measured).
    """
    from mlemlib import metrics

    iterations, repetitions = settings.iterations, settings.repetitions
    records: list[dict[str, Any]] = list(resume["records"]) if resume else []
    start_rep = resume["repetition"] if resume else 0
    every = _log_interval(iterations)
    host_img = None
    for rep in range(start_rep, repetitions):
        times = StepTimes()
        if resume is not None and rep == start_rep:
            f = be.from_host(resume["image"])
            first = resume["iteration"] + 1
            for step, vals in (resume["samples"] or {}).items():
                for v in vals:
                    times.samples.setdefault(step, []).append(float(v))
            rep_resumed = resume["resumed_at"]
        else:
            f = be.initial_image()
            first = 1
            rep_resumed = []
        metered = energy is not None and energy.available
        if metered:
            be.synchronize()  # the initial image's (or the previous repetition's) work is not this loop's
        e0 = energy.read() if metered else None
        caps0 = energy.capped() if metered else None
        t_rep = time.perf_counter()
        t_log = t_rep
        ckpt_s = 0.0
        def note(it: int, step_times: dict[str, float]) -> None:
            """Take iteration ``it``'s step times; log them every ``every`` iterations or 30 s."""
            nonlocal t_log
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

        def due(it: int) -> bool:
            return bool(ckpt_path is not None and settings.checkpoint_every and it % settings.checkpoint_every == 0)

        # A backend that pipelines has its times read one iteration late (timed_iterations): the
        # device never idles between iterations waiting for the host; they are read at once
        # before a checkpoint (which synchronises anyway) and after the last iteration.
        for it, f, ready in timed_iterations(be, f, first, iterations, read_now=due):
            for k, step_times in ready:
                note(k, step_times)
            if due(it):
                t_ck = time.perf_counter()
                state = {"config": config, "records": records, "samples": times.to_json(), "resumed_at": rep_resumed}
                write_checkpoint(ckpt_path, be.to_host(f), key=prob.key, repetition=rep, iteration=it, state=state)
                ckpt_s += time.perf_counter() - t_ck
            if progress is not None:
                progress(rep, it, f)
        if metered:
            be.synchronize()
        e1 = energy.read() if metered else None
        caps1 = energy.capped() if metered else None
        loop_s = time.perf_counter() - t_rep
        joules = e1 - e0 if e0 is not None and e1 is not None else None
        energy_fields = energy_record(joules, loop_s, iterations - first + 1,
                                      energy.note if energy is not None else "not measured",
                                      len(energy.gpus) if energy is not None else 0, capped_between(caps0, caps1))
        with Stopwatch() as sw_back:
            host_img = prob.to_user(be.to_host(f))
        acc = metrics.accuracy(host_img, reference=prob.reference, truth=prob.truth, regions=prob.regions)
        records.append({
            "repetition": rep,
            "iterations": iterations,
            "resumed_at": rep_resumed,
            "wall_s": time.perf_counter() - t_rep,
            "checkpoint_s": ckpt_s,
            "readback_s": sw_back.seconds,
            "steps": times.summary(),
            "samples": times.to_json(),
            "accuracy": acc,
            **energy_fields,
        })
        log.info(
            "repetition %d/%d done: mean %s/iteration, image sum %.9g%s%s",
            rep + 1, repetitions, format_seconds(times.mean("iteration")), acc["image_sum"],
            f", rel. L2 to reference {acc['rel_l2_reference']:.3g}" if "rel_l2_reference" in acc else "",
            f", GPU energy {joules:.4g} J ({energy_fields['power_W']:.4g} W)" if energy_fields["power_W"] else "",
        )
    return records, host_img


def _path_or(value: Any, other: Any = None) -> Any:
    """A path argument as text for ``timings.json``; ``other`` for anything else."""
    return os.fspath(value) if isinstance(value, (str, os.PathLike)) else other


def _timings(prob: Problem, settings: RunSettings, desc: dict[str, Any], be: Backend, records: list[dict],
             config: dict[str, Any], *, sources: dict[str, Any], matrix_name: str | None,
             device_info: dict[str, Any] | None, setup_s: float) -> dict[str, Any]:
    """The content of ``timings.json``: configuration, problem, bytes moved, set-up and every repetition."""
    m, n = prob.shape
    nnz = int(prob.src.nnz)
    used_t = transpose_used(desc.get("transpose"), prob.tsrc is not None)
    # Bytes each projection reads: CSR's 8 per non-zero plus the row pointer, or
    # the bytes of the format on the device (the backend's bytes_per_nnz).
    per_nnz = desc.get("bytes_per_nnz") if desc.get("format", "csr") != "csr" else None
    per_nnz = per_nnz if isinstance(per_nnz, dict) else {}
    bytes_a = round(per_nnz["A"] * nnz) if per_nnz.get("A") else 8 * (m + 1) + 8 * nnz
    bytes_at = None
    if used_t:
        bytes_at = round(per_nnz["AT"] * nnz) if per_nnz.get("AT") else 8 * (n + 1) + 8 * nnz
    # One pass (forward and back projection from one read of A) reads A once an iteration.
    onepass = bool(desc.get("onepass"))
    sino, transpose = sources["sino"], sources["transpose"]
    return {
        "format": TIMINGS_FORMAT,
        "version": FORMAT_VERSION,
        "created": _now(),
        "mlemlib_version": __version__,
        "host": socket.gethostname(),
        "config": {
            "matrix": matrix_name or _matrix_label(sources["matrix"]) or "matrix",
            "matrix_path": _source_name(prob.src, sources["matrix"]),
            "sino": _path_or(sino, "<memory>"),
            "data": Path(sino).name.split(".")[0] if isinstance(sino, (str, os.PathLike)) else "memory",
            "norm": _path_or(sources["norm"]),
            "transpose": _path_or(transpose, None if transpose is None else "<memory>"),
            "reference": _path_or(sources["reference"]),
            "truth": _path_or(sources["truth"]),
            "plan": _path_or(sources["plan"]),
            "backend": config["backend"],
            "fp": config["fp"],
            "bp": config["bp"],
            "fp_requested": settings.fp,
            "bp_requested": settings.bp,
            "secsize": settings.secsize,
            "gpus": settings.gpus,
            "layout": settings.layout,
            "graph": settings.graph,
            "iterations": settings.iterations,
            "repetitions": settings.repetitions,
            "checkpoint_every": settings.checkpoint_every,
            "dtype": str(settings.dtype),
            "reference_mode": settings.reference_mode,
            "reorder": prob.reorder,
        },
        "problem": prob.fingerprint,
        "shape": [m, n],
        "nnz": nnz,
        "fold": None if prob.row_fold is None else {"user_rows": prob.row_fold.m_user, "method": prob.row_fold.method},
        "grid": list(prob.grid) if prob.grid else None,
        "voxel_size": list(prob.voxel_size) if prob.voxel_size else None,
        "backend": desc,
        "deterministic": bool(desc.get("deterministic", be.deterministic)),
        "device": device_info if device_info is not None else desc.get("device", desc.get("devices")),
        "bytes": {
            "A": bytes_a,
            "AT": bytes_at,
            "fp": bytes_a,
            "bp": bytes_at if used_t else bytes_a,
            "iteration": bytes_a if onepass else bytes_a + (bytes_at if used_t else bytes_a),
        },
        "setup": {"load_s": prob.load_s, "backend_s": setup_s},
        "repetitions": records,
    }


def _write_outputs(out_image: Path, host_img: np.ndarray, timings: dict[str, Any], prob: Problem, *, writer: bool,
                   raw_out: Any, timings_out: Any, ckpt_path: Path | None, keep_checkpoint: bool) -> dict[str, Any]:
    """Write ``image.h5``, ``image.raw`` and ``timings.json`` (rank 0 only); drop the checkpoint; return the timings."""
    from mlemlib import metrics

    cfg = timings["config"]
    reference_mode = cfg["reference_mode"]
    attrs = {
        "iterations": cfg["iterations"],
        "repetitions": cfg["repetitions"],
        "backend": cfg["backend"],
        "fp": cfg["fp"],
        "bp": cfg["bp"],
        "gpus": cfg["gpus"],
        "layout": cfg["layout"],
        "dtype": cfg["dtype"],
        "reorder": cfg["reorder"],
        "problem": prob.fingerprint,
        "reference": reference_mode,
        "deterministic": timings["deterministic"],
        "matrix": cfg["matrix_path"],
        "sino": cfg["sino"],
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
    write_image(out_image, host_img, grid=prob.grid, voxel_size=prob.voxel_size, attrs=attrs)
    if raw_path is not None:
        write_raw(raw_path, host_img)
    if tpath is not None:
        with atomic_path(tpath) as tmp:
            tmp.write_text(json.dumps(_finite(timings), indent=1, default=_json_default, allow_nan=False) + "\n")
    if ckpt_path is not None and ckpt_path.exists() and not keep_checkpoint:
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
