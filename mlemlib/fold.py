"""Folded matrices: each distinct row of the system matrix stored once (CPU, NumPy + Numba).

A system matrix with a row for every ordered pair of crystals holds every
line of response twice: row ``(i, j)`` equals row ``(j, i)`` (the madpet2
and matrix3 presets, and the thesis's matrices, are built so). Its diagonal
rows ``(i, i)`` are empty. MLEM gives the same image when such rows are
merged: identical rows have identical forward projections ``p``, so their
terms ``a_ij y_k / p`` in the back projection add up to ``a_ij (sum_k y_k)
/ p``. A *folded* container stores each distinct non-empty row once, in the
order of its first occurrence, and a row map from the user's rows to the
stored ones; every stage reads the measurement in the user's LOR order and
folds it (sums the counts of a stored row's LORs), and the norm counts each
stored row as often as it occurs. Per-LOR factors ``m`` and ``b`` are summed
over a stored row's LORs in the same way: its counts' sum is Poisson with mean
``(sum m_i) (A f)_r + sum b_i`` (:func:`mlemlib.corrections.summed_factors`).
Half the rows mean half the bytes read per iteration, half the gathers and
half the atomics (docs/formats.md, "Folded matrices").

Provides

- :class:`RowFold` — ``row_map[user_row] = stored_row`` (int64, -1 for an
  empty row), the stored row count and how the fold was found; validated,
  with :meth:`RowFold.fold` (measurement: user -> stored rows, summed),
  :meth:`RowFold.unfold` (projection: stored -> user rows, copied) and
  :meth:`RowFold.multiplicity`.
- :func:`pair_fold` — the fold of an every-ordered-pair scanner matrix from
  its geometry alone (what ``mlem generate --fold`` writes).
- :func:`find_duplicates` — the fold of any matrix from its content: a 128-bit
  hash of each row's length, columns and value bits (two independent 64-bit
  hashes, streamed over row blocks); rows with equal hashes are taken as equal.
- :func:`fold_file` — the stage (``mlem fold``, and ``mlem convert --fold``):
  find the duplicates, then stream the first occurrences into a container,
  with the fold attached (:func:`mlemlib.formats.convert`'s ``keep_rows`` and
  ``attach``).
- :func:`fold_of` — the fold stored in a container (None for any other
  matrix); :func:`stored_row_weights` — each stored row's multiplicity in the
  container's row order (the weights of the norm), also for a folded matrix
  that was reordered afterwards.
"""

from __future__ import annotations

from pathlib import Path

import hashlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numba import njit, prange

from mlemlib.errors import ConfigError, MatrixFormatError
from mlemlib.formats._check import DEFAULT_CHUNK_NNZ
from mlemlib.formats.h5 import FOLD_ATTR_USER_ROWS, FOLD_DATASET, marked_container
from mlemlib.formats.spec import matrix_format_of
from mlemlib.image import plain_attr
from mlemlib.matrix import CSRMatrix

log = logging.getLogger(__name__)

#: The container's row map dataset (int64[m_user]) and the attribute with the user's row count.
DATASET = FOLD_DATASET
ATTR_ROWS = FOLD_ATTR_USER_ROWS
#: Further attributes of a folded container: the map's checksum and how it was found.
ATTR_CHECKSUM = "fold_checksum"
ATTR_METHOD = "fold_method"
#: ``pairs``: LOR (i, j) is LOR (j, i) (the generator's geometry); ``content``: rows with equal hashes.
METHODS = ("pairs", "content")


@dataclass(frozen=True)
class RowFold:
    """The map from a user's rows to the stored rows of a folded matrix.

    ``row_map[r]`` is the stored row holding user row ``r``, or -1 where row
    ``r`` is empty (it is not stored). Every stored row is some user row's.
    """

    row_map: np.ndarray
    m_stored: int
    method: str
    _mult: list = field(default_factory=list, repr=False, compare=False)

    @property
    def m_user(self) -> int:
        """The user's row count (the measurement's length)."""
        return int(self.row_map.shape[0])

    @property
    def checksum(self) -> str:
        """BLAKE2b-128 of the stored row count and the map (little-endian int64)."""
        h = hashlib.blake2b(digest_size=16)
        h.update(np.int64(self.m_stored).tobytes())
        h.update(np.ascontiguousarray(self.row_map, dtype="<i8").tobytes())
        return h.hexdigest()

    def multiplicity(self) -> np.ndarray:
        """How many user rows each stored row holds (int64, length ``m_stored``; at least 1)."""
        if not self._mult:
            used = self.row_map[self.row_map >= 0]
            self._mult.append(np.bincount(used, minlength=self.m_stored).astype(np.int64))
        return self._mult[0]

    def check(self, where: str) -> RowFold:
        """Validate the map (values in ``[-1, m_stored)``, every stored row used); return self.

        Raises
        ------
        MatrixFormatError
            One line naming ``where`` and the fault.
        """
        rm = self.row_map
        if rm.ndim != 1 or rm.dtype.kind not in "iu":
            raise MatrixFormatError(where, f"row fold map has shape {rm.shape} and dtype {rm.dtype}, expected int64[m]")
        if self.method not in METHODS:
            raise MatrixFormatError(where, f"fold method {self.method!r}, expected one of {', '.join(METHODS)}")
        if rm.size:
            lo, hi = int(rm.min()), int(rm.max())
            if lo < -1 or hi >= self.m_stored:
                bad = int(np.argmax((rm < -1) | (rm >= self.m_stored)))
                raise MatrixFormatError(
                    where, f"row fold map sends user row {bad} to {int(rm[bad])}, outside [-1, {self.m_stored})"
                )
        used = np.zeros(self.m_stored, dtype=bool)
        used[rm[rm >= 0]] = True
        if not used.all():
            raise MatrixFormatError(where, f"stored row {int(np.argmin(used))} is no user row's (row fold map)")
        return self

    def fold(self, g: Any, what: str = "sino") -> Any:
        """The measurement in the stored rows: each stored row gets the sum of its user rows' counts.

        ``g`` has the user's ``m_user`` values (NumPy or CuPy; the result lives
        where ``g`` lives, in ``g``'s dtype; sums in int64 or float64).
        Counts in empty rows are dropped (no LOR sees them: the unfolded MLEM
        ignores them too). Per-LOR factors ``m`` and ``b`` are summed the same
        way (:func:`mlemlib.corrections.summed_factors`).

        Raises
        ------
        ConfigError
            For a measurement of another length, or sums that overflow an integer dtype.
        """
        xp = _array_module(g)
        if g.ndim != 1 or g.shape[0] != self.m_user:
            raise ConfigError(what, f"measurement has shape {tuple(g.shape)}, the folded matrix's user rows are {self.m_user}")
        rm = xp.asarray(self.row_map)
        keep = rm >= 0
        if self.m_stored:  # float64 sums: exact for counts below 2**53
            out = xp.bincount(rm[keep], weights=g[keep].astype(xp.float64), minlength=self.m_stored)
        else:
            out = xp.zeros(0, dtype=xp.float64)
        if g.dtype.kind in "iu":
            top = float(out.max()) if out.size else 0.0
            if top > np.iinfo(g.dtype).max:
                raise ConfigError(what, f"folded counts reach {top:.0f}, over {g.dtype}'s range")
        return out.astype(g.dtype)

    def unfold(self, p: Any) -> Any:
        """A projection onto the stored rows, copied to every user row of each (0 on empty rows)."""
        xp = _array_module(p)
        if p.ndim != 1 or p.shape[0] != self.m_stored:
            raise ConfigError("projection", f"has shape {tuple(p.shape)}, expected the {self.m_stored} stored rows")
        rm = xp.asarray(self.row_map)
        out = xp.zeros(self.m_user, dtype=p.dtype)
        keep = rm >= 0
        out[keep] = p[rm[keep]]
        return out


def _array_module(a: Any):
    if type(a).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return np


def pair_fold(n_crystals: int, row_counts: np.ndarray) -> tuple[RowFold, np.ndarray]:
    """The fold of an every-ordered-pair matrix (row ``i * N + j``) from its geometry.

    Stored rows are the non-empty rows ``i * N + j`` with ``i < j``,
    ascending (each LOR's first occurrence); row ``j * N + i`` maps to the
    same stored row; empty rows (the diagonal, and LORs that miss the grid)
    map to -1.

    Returns
    -------
    (RowFold, numpy.ndarray)
        The fold and the user row of each stored row (int64, ascending).
    """
    nc = int(n_crystals)
    m = nc * nc
    counts = np.asarray(row_counts).reshape(-1)
    if counts.shape[0] != m:
        raise ValueError(f"{counts.shape[0]} row counts for {nc} crystals (expected {m})")
    i, j = np.triu_indices(nc, k=1)
    upper = i.astype(np.int64) * nc + j
    upper = upper[counts[upper] > 0]  # ascending: triu_indices walks row by row
    row_map = np.full(m, -1, dtype=np.int64)
    k = np.arange(upper.shape[0], dtype=np.int64)
    row_map[upper] = k
    row_map[(upper % nc) * nc + upper // nc] = k
    return RowFold(row_map, int(upper.shape[0]), "pairs"), upper


# --------------------------------------------------------------------------- content hashes

_K1 = np.uint64(0xBF58476D1CE4E5B9)
_K2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S32 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(32)


@njit(cache=True, inline="always")
def _mix(z):
    z = (z ^ (z >> _S30)) * _K1
    z = (z ^ (z >> _S27)) * _K2
    return z ^ (z >> _S31)


@njit(parallel=True, cache=True)
def _row_hashes(indptr, indices, bits, out):  # pragma: no cover - compiled
    seed1 = np.uint64(0x9E3779B97F4A7C15)
    seed2 = np.uint64(0xD6E8FEB86659FD93)
    base = indptr[0]
    for r in prange(indptr.shape[0] - 1):
        lo, hi = indptr[r] - base, indptr[r + 1] - base
        n = np.uint64(hi - lo)
        h1 = _mix(seed1 ^ n)
        h2 = _mix(seed2 + n)
        for p in range(lo, hi):
            x = (np.uint64(np.uint32(indices[p])) << _S32) | np.uint64(bits[p])
            h1 = _mix(h1 ^ x)
            h2 = _mix((h2 + x) * _K1)
        out[r, 0] = h1
        out[r, 1] = h2


def row_hashes(block: CSRMatrix) -> np.ndarray:
    """A 128-bit hash of each row of ``block`` (uint64[k, 2]) from its length, columns and value bits."""
    out = np.empty((block.shape[0], 2), dtype=np.uint64)
    if block.shape[0]:
        p0 = int(block.indptr[0])
        idx = block.indices[p0 : p0 + block.nnz]
        bits = np.ascontiguousarray(block.data[p0 : p0 + block.nnz], dtype=np.float32).view(np.uint32)
        _row_hashes(np.ascontiguousarray(block.indptr, dtype=np.int64), idx, bits, out)
    return out


def find_duplicates(src: Any, *, chunk_nnz: int = 1 << 24, name: str = "<matrix>") -> RowFold:
    """The fold of any opened matrix (or a :class:`CSRMatrix`) from its rows' content (one streamed pass).

    Rows with the same 128-bit hash of (length, columns, value bits) are one
    stored row (at its first occurrence); empty rows map to -1. The chance
    that two different rows of a 5e6-row matrix share a hash is about
    ``m**2 / 2**129`` (1e-26).
    """
    if isinstance(src, CSRMatrix):
        from mlemlib.formats._memory import InMemoryMatrix

        src = InMemoryMatrix(src)
    m = int(src.shape[0])
    hashes = np.empty((m, 2), dtype=np.uint64)
    lengths = np.diff(np.asarray(src.read_indptr(), dtype=np.int64))
    t0 = time.perf_counter()
    next_report = 0.1
    for r0, r1, block in src.iter_chunks(max_nnz=chunk_nnz):
        hashes[r0:r1] = row_hashes(block)
        if m and r1 / m >= next_report:
            el = time.perf_counter() - t0
            log.info("%s: hashed rows up to %d of %d (%.0f%%), ETA %.0f s", name, r1, m, 100.0 * r1 / m,
                     el / r1 * (m - r1))
            next_report = r1 / m + 0.1
    nonempty = np.flatnonzero(lengths > 0)
    keys = np.ascontiguousarray(hashes[nonempty]).view(np.dtype((np.void, 16))).reshape(-1)
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    # stored rows in the order of their first occurrence
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.shape[0])
    row_map = np.full(m, -1, dtype=np.int64)
    row_map[nonempty] = rank[inverse.reshape(-1)]
    return RowFold(row_map, int(order.shape[0]), "content")


# --------------------------------------------------------------------------- containers


def _attachment(fold: RowFold) -> tuple[dict, dict]:
    """The datasets and attributes that store ``fold`` in a container."""
    return (
        {DATASET: np.ascontiguousarray(fold.row_map, dtype="<i8")},
        {ATTR_ROWS: np.int64(fold.m_user), ATTR_CHECKSUM: fold.checksum, ATTR_METHOD: fold.method},
    )


def attach(writer: Any, fold: RowFold) -> None:
    """Store ``fold`` in a container being written (before the writer closes)."""
    writer.attach(*_attachment(fold))


def fold_of(matrix: Any) -> RowFold | None:
    """The fold stored in a container (a path or an opened matrix); None for any other matrix.

    Raises
    ------
    MatrixFormatError
        The container says it is folded but its map is missing, of the wrong
        length, out of range or does not match its checksum.
    """
    import h5py

    path = marked_container(matrix, ATTR_ROWS)
    if path is None:
        return None
    with h5py.File(path, "r") as f:
        m_user = int(plain_attr(f.attrs[ATTR_ROWS]))
        if DATASET not in f or not isinstance(f[DATASET], h5py.Dataset):
            raise MatrixFormatError(path, f"folded ({ATTR_ROWS} = {m_user}) but has no dataset {DATASET!r}")
        row_map = np.asarray(f[DATASET][()])
        shape = plain_attr(f.attrs.get("shape"))
        m_stored = int(np.asarray(shape).reshape(-1)[0])
        method = str(plain_attr(f.attrs.get(ATTR_METHOD, "")))
        checksum = str(plain_attr(f.attrs.get(ATTR_CHECKSUM, "")))
    if row_map.shape != (m_user,):
        raise MatrixFormatError(path, f"{DATASET!r} has shape {row_map.shape}, expected ({m_user},) (the user's rows)")
    fold = RowFold(row_map.astype(np.int64, copy=False), m_stored, method).check(path)
    if fold.checksum != checksum:
        raise MatrixFormatError(path, f"row fold checksum mismatch: attribute says {checksum[:16]}..., "
                                      f"data gives {fold.checksum[:16]}... (file corrupted)")
    return fold


def stored_row_weights(src: Any) -> np.ndarray | None:
    """Each stored row's multiplicity in ``src``'s row order (float64), or None for a matrix that is not folded.

    A folded matrix reordered afterwards (``mlem reorder``) keeps the fold of
    its source; its row ``r`` is the source's stored row ``perm.rows[r]``.
    """
    fold = fold_of(src)
    if fold is None:
        return None
    w = fold.multiplicity().astype(np.float64)
    from mlemlib.permutation import permutation_of

    perm = permutation_of(src)
    return w if perm is None else w[np.asarray(perm.rows)]


def user_rows(src: Any) -> int:
    """The length of the measurement ``src`` reconstructs: the user's rows of a folded matrix, else ``m``."""
    fold = fold_of(src)
    return int(src.shape[0]) if fold is None else fold.m_user


def first_rows(fold: RowFold) -> np.ndarray:
    """Boolean mask of the user rows that are stored (each stored row's first occurrence)."""
    rm = fold.row_map
    users = np.flatnonzero(rm >= 0)
    firsts = np.full(fold.m_stored, fold.m_user, dtype=np.int64)
    np.minimum.at(firsts, rm[users], users)
    first = np.zeros(fold.m_user, dtype=bool)
    first[firsts] = True
    return first


def fold_file(
    source: str | os.PathLike,
    out: str | os.PathLike,
    *,
    fmt: str | None = None,
    code_bits: int | None = None,
    chunk_nnz: int = 1 << 24,
    threads: int | None = None,
) -> dict:
    """The ``fold`` stage (``mlem fold``, ``mlem convert --fold``): ``source``'s distinct non-empty rows once.

    Two streamed passes over the source: :func:`find_duplicates` (hashes),
    then :func:`mlemlib.formats.convert` writing only the first occurrences
    (validated as they pass; an ``.h5`` source is checked against its stored
    checksum) with the map attached. Memory: one chunk, the hashes (16 bytes
    per row) and the map. The output has format ``fmt`` (default: the
    source's; CSR for a file that is not a container) and the source's
    attributes; a compressed source folded into its own format keeps its
    stored values and row scales bit for bit
    (:func:`~mlemlib.formats.compressed_h5.copy_compressed`: a lossy one is
    not rounded again).

    Returns
    -------
    dict
        :func:`~mlemlib.formats.convert`'s summary (``shape`` and ``nnz``
        the stored ones) plus ``user_rows``, ``stored_rows``,
        ``fold_checksum``, ``hash_seconds``.

    Raises
    ------
    MatrixFormatError
        For a corrupt source, or one that is already folded or reordered.
    """
    from mlemlib.formats import convert, open_matrix
    from mlemlib.formats.compressed_h5 import copy_compressed
    from mlemlib.permutation import permutation_of
    from mlemlib.transpose import numba_threads

    name = os.path.basename(os.fspath(source))
    t0 = time.perf_counter()
    with numba_threads(threads):
        with open_matrix(source) as src:
            if fold_of(src) is not None:
                raise MatrixFormatError(source, "is folded already")
            if permutation_of(src) is not None:
                raise MatrixFormatError(source, "is reordered: fold the matrix before reordering it")
            own = matrix_format_of(src).name
            fmt = fmt or own
            fold = find_duplicates(src, chunk_nnz=chunk_nnz, name=name)
        t_hash = time.perf_counter() - t0
        log.info("%s: %d rows, %d distinct non-empty (%.1f%%); hashed in %.1f s", name, fold.m_user, fold.m_stored,
                 100.0 * fold.m_stored / max(fold.m_user, 1), t_hash)
        # a compressed source kept in its format keeps its stored values and row scales bit for bit
        if fmt == own and matrix_format_of(fmt).compressed:
            summary = copy_compressed(source, out, code_bits=code_bits, max_nnz=chunk_nnz,
                                      keep_rows=first_rows(fold), attach=_attachment(fold))
        else:
            summary = convert(source, out, fmt=fmt, code_bits=code_bits, max_nnz=chunk_nnz,
                              keep_rows=first_rows(fold), attach=_attachment(fold))
    summary.update(user_rows=fold.m_user, stored_rows=fold.m_stored, fold_checksum=fold.checksum,
                   hash_seconds=round(t_hash, 3))
    return summary


__all__ = [
    "convert_stage",
    "ATTR_CHECKSUM",
    "ATTR_METHOD",
    "ATTR_ROWS",
    "DATASET",
    "METHODS",
    "RowFold",
    "attach",
    "find_duplicates",
    "first_rows",
    "fold_file",
    "fold_of",
    "pair_fold",
    "row_hashes",
    "stored_row_weights",
    "user_rows",
]


def convert_stage(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    fmt: str | None = None,
    fold: bool = False,
    clip_negative: bool = False,
    code_bits: int | None = None,
    max_nnz: int = DEFAULT_CHUNK_NNZ,
    grid: tuple[int, int, int] | None = None,
    voxel_size: tuple[float, float, float] | None = None,
) -> dict:
    """The convert stage (``mlem convert``, the workflow's ``convert_matrix``): :func:`mlemlib.formats.convert`,
    or with ``fold`` :func:`fold_file`.

    Folding hashes the rows as read, so with both ``fold`` and ``clip_negative``
    the input is first converted with its negative values set to 0 into a
    temporary CSR container beside ``out`` (removed afterwards), which is then
    folded into ``out`` in ``fmt`` (default: the input's format). ``grid`` and ``voxel_size`` (``mlem convert
    --grid --voxel-size``) are recorded in ``out``; with ``fold`` through the same temporary container, whose
    grid the fold keeps.

    Returns
    -------
    dict
        The summary of :func:`~mlemlib.formats.convert` or :func:`fold_file`
        (with ``clipped`` and ``clipped_min`` where ``clip_negative``).
    """
    from mlemlib.formats import convert, matrix_format

    if not fold:
        return convert(src, out, fmt=fmt, code_bits=code_bits, max_nnz=max_nnz, clip_negative=clip_negative,
                       grid=grid, voxel_size=voxel_size)
    if not clip_negative and grid is None and voxel_size is None:
        return fold_file(src, out, fmt=fmt, code_bits=code_bits, chunk_nnz=max_nnz)
    fmt = fmt or matrix_format(src)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.clipped.h5")
    try:
        clip = convert(src, tmp, fmt="csr", max_nnz=max_nnz, clip_negative=clip_negative, grid=grid,
                       voxel_size=voxel_size)
        summary = fold_file(tmp, out, fmt=fmt, code_bits=code_bits, chunk_nnz=max_nnz)
    finally:
        tmp.unlink(missing_ok=True)
    if not clip_negative:
        return summary
    return summary | {"clipped": clip["clipped"], "clipped_min": clip["clipped_min"]}
