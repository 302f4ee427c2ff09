"""What a run records about itself: input fingerprints and the content of ``timings.json`` (host; all backends).

:func:`matrix_fingerprint` and :func:`problem_fingerprint` identify a system
matrix and an MLEM problem (matrix and measurement) without reading all of
the matrix: what a reference image and a checkpoint are checked against.
:func:`timings_record` assembles ``timings.json`` (configuration, problem,
bytes moved per projection, set-up and every repetition) from a run's
settings, its backend's ``describe()`` and its repetition records;
:func:`dumps` writes it as strict JSON (NaN and infinities as null).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import socket
from pathlib import Path
from typing import Any

import numpy as np

from mlemlib import __version__
from mlemlib.formats import InMemoryMatrix, matrix_format_of
from mlemlib.image import FORMAT_VERSION

#: ``format`` of ``timings.json``.
TIMINGS_FORMAT = "mlem-timings"


def utc_now() -> str:
    """The current UTC time, ISO 8601 to the second (``created`` of every file a run writes)."""
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def sha(*parts: bytes | str) -> str:
    """SHA-256 (hex) of the parts, each followed by a NUL byte."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()


def source_name(src: Any, given: Any) -> str:
    """The name of an opened matrix for messages and records: the path it was given as, else its own."""
    if isinstance(given, (str, os.PathLike)):
        return os.fspath(given)
    return str(getattr(src, "source", None) or getattr(src, "path", None) or "<memory>")


def matrix_label(path: Any) -> str | None:
    """``results/{matrix}/matrix.h5`` -> ``{matrix}``; other files: their stem; None for no path."""
    if not isinstance(path, (str, os.PathLike)):
        return None
    p = Path(path)
    if p.stem in ("matrix", "transpose") and p.resolve().parent.name:
        return p.resolve().parent.name
    return p.name.split(".")[0]


def matrix_fingerprint(src: Any) -> str:
    """A hash identifying a system matrix without reading all of it.

    Uses the container's ``checksum`` attribute where there is one, plus the
    shape, nnz and a hash of the row pointer (of a compressed container its
    slot pointer, which is stored: its element row pointer would mean reading
    every code, a fifth of the file); for an in-memory matrix, a hash of all
    three arrays.
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
        if hasattr(src, "read_slotptr"):
            parts.append(np.ascontiguousarray(src.read_slotptr(), dtype=np.int64).tobytes())
        elif hasattr(src, "read_indptr"):
            parts.append(np.ascontiguousarray(src.read_indptr(), dtype=np.int64).tobytes())
        if not checksum and m:
            # No checksum to trust: sample rows at the start, middle and end.
            for r0 in sorted({0, max(0, m // 2 - 512), max(0, m - 1024)}):
                block = src.read_rows(r0, min(m, r0 + 1024))
                parts += [np.ascontiguousarray(block.indices).tobytes(), np.ascontiguousarray(block.data).tobytes()]
    return sha(*parts)


def problem_fingerprint(src: Any, g: np.ndarray, corrections: str = "") -> str:
    """Hash of one MLEM problem: the matrix and the measurement (what a reference is valid for), and the
    subsets and factors where the run models them (``corrections``: :meth:`mlemlib.corrections.Corrections.identity`;
    ``""`` keeps MLEM's fingerprint as it was)."""
    counts = np.ascontiguousarray(g, dtype=np.int64 if g.dtype.kind in "iu" else np.float64).tobytes()
    if not corrections:
        return sha("problem", matrix_fingerprint(src), counts)
    return sha("problem", matrix_fingerprint(src), counts, corrections)


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


def _path_or(value: Any, other: Any = None) -> Any:
    """A path argument as text for ``timings.json``; ``other`` for anything else."""
    return os.fspath(value) if isinstance(value, (str, os.PathLike)) else other


def timings_record(prob: Any, settings: Any, desc: dict[str, Any], be: Any, records: list[dict],
                   config: dict[str, Any], *, sources: dict[str, Any], matrix_name: str | None,
                   device_info: dict[str, Any] | None, setup_s: float, data_name: str | None = None) -> dict[str, Any]:
    """The content of ``timings.json``: configuration, problem, bytes moved, set-up and every repetition.

    Parameters
    ----------
    prob, settings
        The loaded problem and the run's settings (:mod:`mlemlib.problem`).
    desc, be
        The backend's ``describe()`` and the backend.
    records
        One record per repetition (:func:`mlemlib.mlem.reconstruct`'s loop).
    config
        The run's resolved configuration (backend, kernels, ...).
    sources
        What :func:`~mlemlib.mlem.reconstruct` was given: ``matrix``, ``sino``,
        ``norm``, ``transpose``, ``reference``, ``truth``, ``plan`` (paths are
        recorded as text).
    matrix_name, device_info, setup_s
        The matrix's name in tables, device facts, the backend's set-up time.
    data_name
        The measurement's name in tables (default: its file name without the suffix).
    """
    m, n = prob.shape
    nnz = int(prob.src.nnz)
    used_t = transpose_used(desc.get("transpose"), prob.tsrc is not None)
    # Bytes each projection reads: CSR's 8 per non-zero plus the row pointer, or
    # the bytes of the format on the device (the backend's bytes_per_nnz).
    per_nnz = desc.get("bytes_per_nnz") if matrix_format_of(desc.get("format", "csr")).compressed else None
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
        "created": utc_now(),
        "mlemlib_version": __version__,
        "host": socket.gethostname(),
        "config": {
            "matrix": matrix_name or matrix_label(sources["matrix"]) or "matrix",
            "matrix_path": source_name(prob.src, sources["matrix"]),
            "sino": _path_or(sino, "<memory>"),
            "data": data_name or (Path(sino).name.split(".")[0] if isinstance(sino, (str, os.PathLike)) else "memory"),
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
            "graph": bool(config.get("graph", False)),  # whether the run replayed CUDA graphs
            "graph_requested": "auto" if settings.graph is None else bool(settings.graph),
            "iterations": settings.iterations,
            "repetitions": settings.repetitions,
            "checkpoint_every": settings.checkpoint_every,
            "dtype": str(settings.dtype),
            "reference_mode": settings.reference_mode,
            "reorder": prob.reorder,
            **prob.corrections.record(),
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


def finite(o: Any) -> Any:
    """A copy of nested dicts/lists with NaN and infinities replaced by None (strict JSON)."""
    if isinstance(o, dict):
        return {k: finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [finite(v) for v in o]
    if isinstance(o, (float, np.floating)):
        return float(o) if math.isfinite(o) else None
    return o


def json_default(o: Any) -> Any:
    """``json.dumps``'s ``default``: NumPy scalars and arrays, paths; a non-finite float as None."""
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return os.fspath(o)
    if isinstance(o, float) and not math.isfinite(o):
        return None
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def dumps(o: Any, **kw: Any) -> str:
    """``o`` as strict JSON: NaN and infinities become null, NumPy values plain ones (:func:`json_default`)."""
    return json.dumps(finite(o), default=json_default, **kw)
