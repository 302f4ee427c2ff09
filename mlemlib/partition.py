"""nnz-balanced partitioning of the system matrix for P GPUs (CPU; NumPy + Numba).

Provides :func:`balanced_bounds` (the split rule), :func:`imbalance`,
:func:`make_plan` (the plan of one matrix, in memory), :func:`split_transpose`
(``A^T`` -> the transposes ``A_k^T`` of the row blocks), :func:`partition_file`
(the ``partition`` stage: ``plan.json``, plus ``part-{k}.h5`` only where a
run needs ``A_k^T`` stored) and :func:`read_plan` (load and validate a plan,
resolving its paths).

The split follows the thesis (ch. 8: row blocks balanced by non-zeros) with
MSREP's balance rule and pCSR idea (sections 3-4): part ``s`` starts at the
first row whose cumulative non-zero count ``indptr[r]`` reaches
``s * nnz / P`` (``searchsorted`` on the row pointer), whole rows only, so no
row is shared and no partial results need merging. A part is a *reference* to
a contiguous range of ``matrix.h5``: its row range, its non-zero offset
``indptr[r0]`` and count; its local row pointer is ``indptr[r0:r1+1] -
indptr[r0]``, computed by whoever loads the range. No data of a contiguous
range is copied.

Two multi-GPU layouts are planned together:

``thesis``
    GPU ``k`` owns row block ``k`` of ``A`` (forward projection, then an
    all-reduce of the m-vector) and an nnz-balanced row block of ``A^T``
    (back projection, then an all-reduce of the image): both contiguous
    ranges of ``matrix.h5`` and ``transpose.h5``, referenced.
``local``
    GPU ``k`` owns row block ``k`` of ``A`` and ``A_k^T``, the transpose of
    that block (shape ``(n, r1 - r0)``), so one all-reduce of the n-vector per
    iteration suffices. A back projection without a transpose (``notrans``,
    the one-pass iteration) needs nothing more than the reference to ``A``'s
    rows. One that reads ``A_k^T`` gets it either from the GPU (which
    transposes its block) or, when the stage is asked (``local_transpose``),
    from ``part-{k}.h5``: ``A_k^T`` is not contiguous in ``transpose.h5``, so
    it is written out; the rows of ``A^T`` have sorted LOR indices, so each
    row splits into P contiguous segments at the block boundaries. Streaming
    ``transpose.h5`` in chunks, all P files take one copy of ``A^T`` on disk in
    all, in the transpose's format (a compressed transpose gives compressed
    parts, its stored values and row scales kept bit for bit). Without ``local_transpose`` the stage writes ``plan.json`` only: no
    element of the matrix is copied.

Every count and offset is an int64 (NumPy) or a Python int (JSON): plans of
matrices with more than 2**32 non-zeros are exact.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path

import numpy as np
from numba import njit, prange

from mlemlib._io import atomic_dir
from mlemlib.errors import ConfigError, MatrixFormatError
from mlemlib.formats.spec import matrix_format_of
from mlemlib.matrix import INDEX_DTYPE, INDPTR_DTYPE, CSRMatrix
from mlemlib.transpose import DEFAULT_CHUNK_NNZ, numba_threads

log = logging.getLogger(__name__)

PLAN_FORMAT = "mlem-plan"
PLAN_VERSION = 1
PLAN_NAME = "plan.json"


# --------------------------------------------------------------------------- the split rule


def _check_parts(parts) -> int:
    if isinstance(parts, bool) or not isinstance(parts, (int, np.integer)) or parts < 1:
        raise ConfigError("parts", f"{parts!r} is not a positive number of parts")
    return int(parts)


def balanced_bounds(indptr: np.ndarray, parts: int) -> np.ndarray:
    """Row boundaries of ``parts`` nnz-balanced, contiguous, covering row blocks.

    Part ``s`` is rows ``[b[s], b[s+1])`` with ``b[0] = 0``, ``b[P] = m`` and,
    for ``0 < s < P``, ``b[s]`` the first row ``r`` with ``indptr[r] >= s * nnz / P``
    (exact integer arithmetic). Rows are never split; parts may be empty when
    ``P`` exceeds the number of non-empty rows (or ``nnz == 0``).

    Parameters
    ----------
    indptr
        The full row pointer (``m + 1`` entries, starting at 0, non-decreasing).
    parts
        Number of parts ``P >= 1``.

    Returns
    -------
    numpy.ndarray
        int64 boundaries, ``P + 1`` entries, non-decreasing.
    """
    parts = _check_parts(parts)
    indptr = np.asarray(indptr)
    m = len(indptr) - 1
    nnz = int(indptr[-1]) if m >= 0 else 0
    # ceil(s * nnz / P) with Python integers (no overflow): indptr[r] >= s*nnz/P <=> indptr[r] >= ceil(...)
    targets = np.array([-((-s * nnz) // parts) for s in range(parts + 1)], dtype=np.int64)
    bounds = np.searchsorted(indptr, targets, side="left").astype(np.int64)
    bounds[0] = 0
    bounds[-1] = m
    return np.minimum(bounds, m)


def part_nnz(indptr: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Non-zeros of each part (int64, ``P`` entries)."""
    return np.diff(np.asarray(indptr, dtype=np.int64)[bounds])


def imbalance(nnz_per_part: np.ndarray | list[int]) -> float:
    """Load imbalance: the largest part's non-zeros over the mean (1.0 is perfect; 1.0 when nnz is 0)."""
    a = np.asarray(nnz_per_part, dtype=np.float64)
    total = a.sum()
    if a.size == 0 or total == 0:
        return 1.0
    return float(a.max() / (total / a.size))


def _layout(indptr: np.ndarray, parts: int) -> dict:
    bounds = balanced_bounds(indptr, parts)
    nnz = part_nnz(indptr, bounds)
    return {
        "bounds": bounds,
        "ranges": [[int(bounds[k]), int(bounds[k + 1])] for k in range(parts)],
        "nnz_per_part": [int(v) for v in nnz],
        "nnz_offsets": [int(indptr[bounds[k]]) for k in range(parts)],
        "imbalance": imbalance(nnz),
    }


def make_plan(indptr: np.ndarray, transpose_indptr: np.ndarray | None, parts: int, shape: tuple[int, int]) -> dict:
    """The plan of ``parts`` GPUs for a matrix with row pointer ``indptr`` (no paths).

    Parameters
    ----------
    indptr
        Row pointer of ``A`` (``m + 1`` entries).
    transpose_indptr
        Row pointer of ``A^T`` (``n + 1`` entries), or None to plan only the
        row blocks of ``A``.
    parts
        Number of GPUs ``P``.
    shape
        ``(m, n)``.

    Returns
    -------
    dict
        The plan's JSON-able fields (see :func:`partition_file`) without paths.
    """
    parts = _check_parts(parts)
    m, n = int(shape[0]), int(shape[1])
    rows = _layout(indptr, parts)
    plan = {
        "format": PLAN_FORMAT,
        "version": PLAN_VERSION,
        "parts": parts,
        "shape": [m, n],
        "nnz": int(indptr[-1]),
        "imbalance": rows["imbalance"],
        "rows": rows["ranges"],
        "nnz_per_part": rows["nnz_per_part"],
        "nnz_offsets": rows["nnz_offsets"],
    }
    if transpose_indptr is not None:
        cols = _layout(transpose_indptr, parts)
        plan.update(
            {
                "transpose_imbalance": cols["imbalance"],
                "transpose_rows": cols["ranges"],
                "transpose_nnz_per_part": cols["nnz_per_part"],
                "transpose_nnz_offsets": cols["nnz_offsets"],
            }
        )
    return plan


# --------------------------------------------------------------------------- splitting A^T


@njit(parallel=True, cache=True)
def _split_points(indptr, indices, bounds, seg):  # pragma: no cover - compiled
    """For each row ``i``: ``seg[i, p]`` = first position whose index is >= ``bounds[p]``.

    ``seg[i, 0]`` and ``seg[i, P]`` are the row's start and end. Returns the
    first row whose indices are not sorted (or out of ``[bounds[0], bounds[P])``), or -1.
    """
    rows = indptr.shape[0] - 1
    nparts = bounds.shape[0] - 1
    bad = np.full(rows, False)
    for i in prange(rows):
        lo = indptr[i]
        hi = indptr[i + 1]
        for k in range(lo + 1, hi):
            if indices[k] < indices[k - 1]:
                bad[i] = True
        if hi > lo and (indices[lo] < bounds[0] or indices[hi - 1] >= bounds[nparts]):
            bad[i] = True
        seg[i, 0] = lo
        seg[i, nparts] = hi
        for p in range(1, nparts):
            a = lo
            b = hi
            target = bounds[p]
            while a < b:
                mid = (a + b) // 2
                if indices[mid] < target:
                    a = mid + 1
                else:
                    b = mid
            seg[i, p] = a
    for i in range(rows):
        if bad[i]:
            return i
    return -1


@njit(parallel=True, cache=True)
def _gather_parts(indices, data, seg, lptr, base, bounds, out_indices, out_data):  # pragma: no cover
    """Copy each row's segment ``p`` to part ``p``'s block, with indices local to the part."""
    rows = seg.shape[0]
    nparts = seg.shape[1] - 1
    for i in prange(rows):
        for p in range(nparts):
            s0 = seg[i, p]
            s1 = seg[i, p + 1]
            dst = base[p] + lptr[p, i]
            off = bounds[p]
            for k in range(s0, s1):
                out_indices[dst + k - s0] = indices[k] - off
                out_data[dst + k - s0] = data[k]


def split_transpose(
    block: CSRMatrix,
    bounds: np.ndarray,
    *,
    row0: int = 0,
    source: str | os.PathLike = "<transpose>",
) -> list[CSRMatrix]:
    """Split rows of ``A^T`` at the row-block boundaries of ``A``.

    Parameters
    ----------
    block
        Rows ``row0 ..`` of ``A^T`` (shape ``(k, m)``), each row with sorted
        column (LOR) indices.
    bounds
        Row boundaries of ``A`` (``P + 1`` entries, :func:`balanced_bounds`).
    row0
        Global index of the block's first row, for messages.
    source
        File named in errors.

    Returns
    -------
    list[CSRMatrix]
        For each part ``p`` the same rows of ``A_p^T``: shape
        ``(k, bounds[p+1] - bounds[p])``, column indices local to the part
        (LOR ``- bounds[p]``).

    Raises
    ------
    MatrixFormatError
        If a row's indices are not sorted (or outside ``[0, m)``).
    """
    bounds = np.asarray(bounds, dtype=np.int64)
    return [
        CSRMatrix(ip, idx, dat, (block.shape[0], width))
        for ip, idx, dat, width in _split_rows(block.indptr, block.indices, block.data, bounds, row0, source)
    ]


def _split_rows(
    indptr: np.ndarray, indices: np.ndarray, data: np.ndarray, bounds: np.ndarray, row0: int, source
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, int]]:
    """:func:`split_transpose` on arrays: ``(indptr, indices, data, width)`` per part; ``data`` of any dtype
    (float32 values, or the stored value bits of a compressed transpose) is copied as it is."""
    nparts = len(bounds) - 1
    k = len(indptr) - 1
    p0 = int(indptr[0]) if len(indptr) else 0
    indptr = np.asarray(indptr, dtype=np.int64)
    indptr = indptr - p0 if p0 else indptr
    nnz = int(indptr[-1]) if len(indptr) else 0
    indices = indices[p0 : p0 + nnz]
    data = data[p0 : p0 + nnz]
    seg = np.empty((k, nparts + 1), dtype=np.int64)
    bad = _split_points(indptr, indices, bounds, seg)
    if bad >= 0:
        raise MatrixFormatError(
            source,
            f"row {row0 + bad} of the transpose has unsorted column indices or one outside "
            f"[{int(bounds[0])}, {int(bounds[-1])}); write it with 'mlem transpose'",
        )
    counts = np.diff(seg, axis=1)  # (k, P)
    lptr = np.zeros((nparts, k + 1), dtype=INDPTR_DTYPE)
    np.cumsum(counts.T, axis=1, out=lptr[:, 1:])
    sizes = lptr[:, -1]
    base = np.zeros(nparts, dtype=np.int64)
    np.cumsum(sizes[:-1], out=base[1:])
    out_indices = np.empty(nnz, dtype=INDEX_DTYPE)
    out_data = np.empty(nnz, dtype=data.dtype)
    _gather_parts(indices, data, seg, lptr, base, bounds, out_indices, out_data)
    parts = []
    for p in range(nparts):
        lo, hi = int(base[p]), int(base[p] + sizes[p])
        parts.append((lptr[p], out_indices[lo:hi], out_data[lo:hi], int(bounds[p + 1] - bounds[p])))
    return parts


# --------------------------------------------------------------------------- the stage


def _relpath(target: str | os.PathLike, start: Path) -> str:
    """``target`` relative to ``start`` (absolute where no relative path exists)."""
    target = Path(target).resolve()
    try:
        return os.path.relpath(target, start.resolve())
    except ValueError:  # another drive
        return os.fspath(target)


def partition_file(
    matrix_h5: str | os.PathLike,
    transpose_h5: str | os.PathLike | None,
    parts: int,
    out_dir: str | os.PathLike,
    *,
    local_transpose: bool = False,
    chunk_nnz: int = DEFAULT_CHUNK_NNZ,
    threads: int | None = None,
) -> dict:
    """The ``partition`` stage: write ``out_dir/plan.json`` (and ``out_dir/part-{k}.h5`` when asked).

    The plan *references* ``matrix.h5``: each part is a row range with its
    non-zero offset and count, read by whoever loads it (MSREP's pCSR); no
    element is copied. Only the row pointers are read (for a compressed
    container, its codes once: one byte per slot). With ``transpose_h5`` the
    plan also has the nnz-balanced row blocks of ``A^T`` (thesis layout),
    referencing ``transpose.h5``. With ``local_transpose`` the stage also
    streams ``transpose.h5`` once in row chunks, splitting each chunk into
    the P local transposes ``A_k^T``, written as ``part-{k}.h5`` (one copy
    of ``A^T`` on disk in all): ask for it only where a run reads a stored
    ``A_k^T`` in the local layout (the GPUs can also transpose their blocks
    themselves). The whole directory is written atomically.

    Memory: the row pointers (8 bytes per row of ``A``, and of ``A^T``);
    with ``local_transpose`` also one chunk of ``A^T`` and its split copy
    (8 + 8 bytes per chunk non-zero) and ``(P + 1)`` int64 split points per
    chunk row.

    ``plan.json`` fields: ``format="mlem-plan"``, ``version``, ``parts``,
    ``shape`` ``[m, n]``, ``nnz``, ``imbalance`` (max over mean of
    ``nnz_per_part``), ``rows`` (half-open ``[r0, r1)`` per part),
    ``nnz_per_part``, ``nnz_offsets`` (``indptr[r0]``), ``matrix`` (path),
    ``matrix_checksum``, ``matrix_format`` (``csr``, ``compressed``,
    ``compressed-f16``), for a compressed container ``slot_offsets`` and
    ``slots_per_part`` (where each part's encoded slots start in the file,
    and how many), ``reference`` (a sentence saying what the ranges refer
    to), ``paths = "relative to the plan's directory"``; with a transpose
    also ``transpose_rows``, ``transpose_nnz_per_part``,
    ``transpose_nnz_offsets``, ``transpose_imbalance``, ``transpose``,
    ``transpose_checksum``; with ``local_transpose`` also
    ``local_transpose`` (``part-{k}.h5`` file names).

    Parameters
    ----------
    matrix_h5
        The matrix container (CSR or compressed).
    transpose_h5
        Its transpose (from ``mlem transpose``), or None.
    parts
        Number of GPUs ``P >= 1``.
    out_dir
        The parts directory (replaced atomically when complete).
    local_transpose
        Also write ``part-{k}.h5`` (``A_k^T``); needs ``transpose_h5``.
    chunk_nnz
        Non-zeros per streamed chunk of ``A^T``.
    threads
        Numba threads for the split (None: all).

    Returns
    -------
    dict
        The plan as written, with ``matrix``, ``transpose`` and
        ``local_transpose`` resolved to absolute paths, plus ``plan`` (its
        path) and ``disk_bytes`` (what the stage wrote).

    Raises
    ------
    ConfigError
        For ``parts < 1``, a bad chunk size, or ``local_transpose`` without a transpose.
    MatrixFormatError
        If a file is corrupt or the transpose does not match the matrix.
    """
    from mlemlib.formats.h5 import MatrixH5

    parts = _check_parts(parts)
    if not isinstance(chunk_nnz, (int, np.integer)) or chunk_nnz < 1:
        raise ConfigError("chunk_nnz", f"{chunk_nnz!r} is not a positive number of non-zeros")
    if local_transpose and transpose_h5 is None:
        raise ConfigError("local_transpose", "writing the parts' transposes A_k^T needs the transpose (A^T)")
    out_dir = Path(out_dir)
    with contextlib.ExitStack() as stack:
        a = stack.enter_context(MatrixH5(matrix_h5))
        at = stack.enter_context(MatrixH5(transpose_h5)) if transpose_h5 is not None else None
        stack.enter_context(numba_threads(threads))
        m, n = a.shape
        if at is not None:
            if at.shape != (n, m) or at.nnz != a.nnz:
                raise MatrixFormatError(
                    transpose_h5,
                    f"shape {at.shape} with {at.nnz} non-zeros is not the transpose of {a.shape} with {a.nnz}",
                )
            came_from = at.attrs.get("source_checksum")
            if came_from is not None and came_from != a.checksum:
                raise MatrixFormatError(
                    transpose_h5,
                    f"is the transpose of a matrix with checksum {came_from}, not of {matrix_h5} ({a.checksum})",
                )
        indptr = a.read_indptr()
        t_indptr = at.read_indptr() if at is not None else None
        plan = make_plan(indptr, t_indptr, parts, (m, n))
        del indptr, t_indptr
        bounds = np.array([r[0] for r in plan["rows"]] + [m], dtype=np.int64)
        empty = [k for k, v in enumerate(plan["nnz_per_part"]) if v == 0]
        if empty:
            log.warning("%d of %d parts are empty (parts %s): more parts than non-empty rows", len(empty), parts, empty)
        log.info(
            "%s: %d parts, imbalance %.4f (A)%s; rows referenced, %s",
            Path(matrix_h5).name, parts, plan["imbalance"],
            f", {plan['transpose_imbalance']:.4f} (A^T row blocks)" if at is not None else "",
            "A_k^T written as part-{k}.h5" if local_transpose else "nothing copied",
        )  # fmt: skip
        spec = matrix_format_of(a)
        plan.update(
            {
                "paths": "relative to the plan's directory",
                "reference": (
                    "each part is rows [r0, r1) of 'matrix' (its elements start at nnz_offsets[k]); "
                    "nothing is copied: read the range from the matrix file"
                ),
                "matrix": _relpath(matrix_h5, out_dir),
                "matrix_checksum": a.checksum,
                "matrix_format": spec.name,
            }
        )
        if spec.compressed:
            sp = a.read_slotptr()
            slot_off = [int(sp[b]) for b in bounds[:-1]]
            plan["slot_offsets"] = slot_off
            plan["slots_per_part"] = [int(sp[bounds[k + 1]]) - slot_off[k] for k in range(parts)]
            del sp
        if at is not None:
            plan.update({"transpose": _relpath(transpose_h5, out_dir), "transpose_checksum": at.checksum})
        names = [f"part-{k}.h5" for k in range(parts)]
        if local_transpose:
            plan["local_transpose"] = names
        with atomic_dir(out_dir) as tmp:
            if local_transpose:
                _write_local_transposes(a, at, plan, bounds, names, tmp, transpose_h5, chunk_nnz)
            with open(tmp / PLAN_NAME, "w", encoding="utf-8") as f:
                json.dump(plan, f, indent=1)
                f.write("\n")
    out = read_plan(out_dir)
    out["disk_bytes"] = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file())
    log.info("wrote %s (%d parts, %.3g MB)", out_dir, parts, out["disk_bytes"] / 1e6)
    return out


def _write_local_transposes(a, at, plan, bounds, names, tmp, transpose_h5, chunk_nnz) -> None:
    """Stream ``transpose.h5`` once, writing each part's ``A_k^T`` to ``tmp/part-{k}.h5`` in the transpose's format.

    A compressed transpose is split as its columns and stored value bits, and
    each part's row keeps the row scale of the row of ``A^T`` it comes from:
    the parts decode to exactly the column ranges of the decoded transpose
    (a lossy one is not rounded again); their code width is the transpose's.
    """
    from mlemlib.formats.compressed_h5 import CompressedH5, CompressedH5Writer
    from mlemlib.formats.h5 import MatrixH5Writer

    m, n = a.shape
    parts = len(names)
    compressed = isinstance(at, CompressedH5)
    writers = []
    try:
        for k in range(parts):
            r0, r1 = plan["rows"][k]
            kw = {"fmt": at.format, "code_bits": at.code_bits} if compressed else {}
            writers.append(
                (CompressedH5Writer if compressed else MatrixH5Writer)(
                    tmp / names[k], (n, r1 - r0), plan["nnz_per_part"][k],
                    source=Path(transpose_h5).name,
                    kind="local_transpose", part=k, parts=parts,
                    rows=np.array([r0, r1], dtype=np.int64),
                    source_checksum=at.checksum, matrix_checksum=a.checksum, **kw,
                )
            )  # fmt: skip
        next_report = 0.1
        chunks = at.iter_element_bits(chunk_nnz) if compressed else at.iter_chunks(max_nnz=chunk_nnz)
        for c0, c1, block in chunks:
            if compressed:
                csr = block.csr
                pieces = _split_rows(csr.indptr, csr.indices, block.bits, bounds, c0, transpose_h5)
                for w, (ip, idx, bits, _) in zip(writers, pieces):
                    w.write_element_bits(ip, idx, bits, block.scale)
            else:
                for w, piece in zip(writers, split_transpose(block, bounds, row0=c0, source=transpose_h5)):
                    w.write_rows(piece, validate=False)
            if n and c1 / n >= next_report:
                log.info("split transpose rows up to %d of %d (%.0f%%)", c1, n, 100.0 * c1 / n)
                next_report = c1 / n + 0.1
        for w in writers:
            w.close()
    except BaseException:
        for w in writers:
            w.abort()
        raise


# --------------------------------------------------------------------------- reading a plan


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_ranges(path, plan: dict, key: str, length: int, nnz_key: str, off_key: str, nnz: int) -> None:
    parts = plan["parts"]
    ranges = plan[key]
    if not (isinstance(ranges, list) and len(ranges) == parts):
        raise MatrixFormatError(path, f"'{key}' must list {parts} ranges")
    prev = 0
    for k, r in enumerate(ranges):
        if not (isinstance(r, list) and len(r) == 2 and all(_is_int(v) for v in r)):
            raise MatrixFormatError(path, f"'{key}'[{k}] is {r!r}, expected [start, stop]")
        if r[0] != prev or r[1] < r[0]:
            raise MatrixFormatError(path, f"'{key}'[{k}] = {r} does not continue at {prev}: ranges must be contiguous")
        prev = r[1]
    if prev != length:
        raise MatrixFormatError(path, f"'{key}' ends at {prev}, expected {length}")
    counts, offsets = plan[nnz_key], plan[off_key]
    if not (isinstance(counts, list) and len(counts) == parts and all(_is_int(v) and v >= 0 for v in counts)):
        raise MatrixFormatError(path, f"'{nnz_key}' must list {parts} non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == parts and all(_is_int(v) for v in offsets)):
        raise MatrixFormatError(path, f"'{off_key}' must list {parts} integers")
    expected = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist() if parts else []
    if offsets != expected or sum(counts) != nnz:
        raise MatrixFormatError(path, f"'{off_key}' and '{nnz_key}' disagree with each other or with nnz = {nnz}")


def read_plan(out_dir_or_plan_json: str | os.PathLike) -> dict:
    """Load and validate a ``plan.json``; resolve its paths.

    Parameters
    ----------
    out_dir_or_plan_json
        The parts directory or the ``plan.json`` in it.

    Returns
    -------
    dict
        The plan, with ``matrix``, ``transpose`` and ``local_transpose``
        resolved to absolute paths (strings) and ``plan`` set to the
        ``plan.json`` path.

    Raises
    ------
    MatrixFormatError
        If the file is missing, not JSON, or its fields are missing or
        inconsistent (ranges not contiguous and covering, non-zero counts
        that do not add up, a missing part file).
    """
    p = Path(out_dir_or_plan_json)
    if p.is_dir():
        p = p / PLAN_NAME
    if not p.is_file():
        raise MatrixFormatError(p, "no such plan file (run 'mlem partition')")
    try:
        plan = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MatrixFormatError(p, f"not a readable JSON plan ({exc})") from None
    if not isinstance(plan, dict) or plan.get("format") != PLAN_FORMAT:
        raise MatrixFormatError(p, f"not a partition plan (format must be {PLAN_FORMAT!r})")
    if plan.get("version") != PLAN_VERSION:
        raise MatrixFormatError(p, f"unsupported plan version {plan.get('version')!r}, expected {PLAN_VERSION}")
    required = ("parts", "shape", "nnz", "imbalance", "rows", "nnz_per_part", "nnz_offsets", "matrix")
    for key in required:
        if key not in plan:
            raise MatrixFormatError(p, f"missing field {key!r}")
    parts, shape, nnz = plan["parts"], plan["shape"], plan["nnz"]
    if not (_is_int(parts) and parts >= 1):
        raise MatrixFormatError(p, f"'parts' is {parts!r}, expected a positive integer")
    if not (isinstance(shape, list) and len(shape) == 2 and all(_is_int(v) and v >= 0 for v in shape)):
        raise MatrixFormatError(p, f"'shape' is {shape!r}, expected [m, n]")
    if not (_is_int(nnz) and nnz >= 0):
        raise MatrixFormatError(p, f"'nnz' is {nnz!r}, expected a non-negative integer")
    _check_ranges(p, plan, "rows", shape[0], "nnz_per_part", "nnz_offsets", nnz)
    expected = imbalance(plan["nnz_per_part"])
    found = plan["imbalance"]
    if isinstance(found, bool) or not isinstance(found, (int, float)) or not np.isclose(found, expected, rtol=1e-12):
        raise MatrixFormatError(p, f"'imbalance' is {found!r}, but the non-zeros per part give {expected!r}")
    if "transpose_rows" in plan:
        for key in ("transpose_nnz_per_part", "transpose_nnz_offsets"):
            if key not in plan:
                raise MatrixFormatError(p, f"missing field {key!r}")
        _check_ranges(p, plan, "transpose_rows", shape[1], "transpose_nnz_per_part", "transpose_nnz_offsets", nnz)
    if "slot_offsets" in plan:
        offs, sizes = plan["slot_offsets"], plan.get("slots_per_part")
        ok = isinstance(offs, list) and isinstance(sizes, list) and len(offs) == len(sizes) == parts
        ok = ok and all(_is_int(v) and v >= 0 for v in offs + sizes)
        if not ok or any(offs[k] + sizes[k] != offs[k + 1] for k in range(parts - 1)) or (offs and offs[0] != 0):
            raise MatrixFormatError(p, f"'slot_offsets' and 'slots_per_part' must list {parts} contiguous slot ranges")
    base = p.parent.resolve()
    plan["matrix"] = os.path.normpath(base / plan["matrix"])
    if plan.get("transpose") is not None:
        plan["transpose"] = os.path.normpath(base / plan["transpose"])
    if "local_transpose" in plan:
        names = plan["local_transpose"]
        if not (isinstance(names, list) and len(names) == parts and all(isinstance(s, str) for s in names)):
            raise MatrixFormatError(p, f"'local_transpose' must list {parts} file names")
        plan["local_transpose"] = [os.path.normpath(base / s) for s in names]
        for s in plan["local_transpose"]:
            if not Path(s).is_file():
                raise MatrixFormatError(p, f"part file {s} is missing")
    plan["plan"] = os.fspath(p)
    return plan
