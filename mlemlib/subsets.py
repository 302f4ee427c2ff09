"""OSEM subsets: which LOR belongs to which subset, the row order that groups them, and their sensitivities (CPU).

Provides

- :func:`labels_for` — one int32 label in ``[0, S)`` per stored row of a
  user's matrix (before any reorder): by projection angle where the matrix
  knows its scanner (a preset's or a ``.csr4``'s scanner block, :func:`angle_labels`),
  else row ``i`` in subset ``i mod S`` (:func:`index_labels`), or a user's
  subset file (one int32 per LOR, raw little-endian, :func:`read_subset_file`).
- :func:`order` — a stable row order that groups the subsets (subset-major,
  keeping a given order inside each) and the subsets' row bounds;
  :func:`bounds_of` — the bounds of labels already grouped.
- :func:`update_norms` — what every backend's update divides by, from the
  float64 per-subset sensitivities ``s^k_j = sum_{i in S_k} a_ij m_i``
  (:func:`mlemlib.norm.sensitivities`); :func:`sensitivities_of` — the
  sensitivities, their sum and its inverse back from those norms.

A label vector is checked in one place (:func:`check_labels`): the right
length, every label in range, no subset empty; a fault is one line naming
the file or key.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

import numpy as np

from mlemlib.errors import ConfigError

log = logging.getLogger(__name__)

#: How a label vector was made: ``angle`` (the scanner's projection angles), ``index`` (row i in subset
#: i mod S) or ``file`` (a user's subset file).
METHODS = ("angle", "index", "file")


def check_count(subsets: Any, what: str = "subsets") -> int:
    """``subsets`` as an int >= 1 (the subset count S), or one line naming ``what``."""
    if isinstance(subsets, bool) or not isinstance(subsets, (int, np.integer)) or int(subsets) < 1:
        raise ConfigError(what, f"must be an integer >= 1, got {subsets!r}")
    return int(subsets)


def check_labels(labels: Any, m: int, subsets: int, source: str | os.PathLike) -> np.ndarray:
    """``labels`` as int32[m] after checking its length, its range ``[0, S)`` and that no subset is empty.

    Raises
    ------
    ConfigError
        Naming ``source``: the wrong length, a label out of range, an empty subset.
    """
    lab = np.asarray(labels).reshape(-1)
    if lab.size != m:
        raise ConfigError(source, f"{lab.size} subset labels, expected one per LOR ({m})")
    if lab.size and (int(lab.min()) < 0 or int(lab.max()) >= subsets):
        bad = int(lab.min()) if int(lab.min()) < 0 else int(lab.max())
        raise ConfigError(source, f"subset label {bad} at LOR {int(np.argmax(lab == bad))}, expected 0 .. {subsets - 1}")
    counts = np.bincount(lab.astype(np.int64), minlength=subsets)
    if (counts == 0).any():
        raise ConfigError(source, f"subset {int(np.argmax(counts == 0))} of {subsets} holds no LOR")
    return lab.astype(np.int32, copy=False)


def index_labels(m: int, subsets: int) -> np.ndarray:
    """Row ``i`` in subset ``i mod S`` (int32[m])."""
    return (np.arange(m, dtype=np.int64) % subsets).astype(np.int32)


def angle_labels(cfg: Any, subsets: int, *, block: int = 1 << 22) -> np.ndarray:
    """Subset of every LOR ``i * n_crystals + j`` of a scanner by its projection angle (int32[n_crystals**2]).

    The angle of the line between the crystals' face centres in the ``x, y``
    plane, in ``[0, pi)`` (the same bits for ``(i, j)`` and ``(j, i)``), orders
    the LORs (then their number); ``V = crystals_per_ring`` views take equal
    shares of them in that order (the LORs ``(i, j)`` and ``(j, i)`` in one; a
    LOR without a transaxial direction, one crystal or one position in two
    rings, has angle 0), and view ``v`` is in subset ``v mod S``: interleaved
    angular sectors, the usual OSEM choice (every subset sees the whole
    object), with about m / S LORs each.
    """
    from mlemlib.scanner.geometry import crystal_faces

    centres = crystal_faces(cfg)[0]
    nc = int(cfg.n_crystals)
    x, y = centres[:, 0], centres[:, 1]
    m = nc * nc
    phi = np.empty(m, dtype=np.float64)
    pair = np.empty(m, dtype=np.int64)  # the LOR's number with i <= j: (i, j) and (j, i) share it
    for r0 in range(0, m, block):
        r = np.arange(r0, min(r0 + block, m), dtype=np.int64)
        i, j = np.minimum(r // nc, r % nc), np.maximum(r // nc, r % nc)
        phi[r0 : r0 + len(r)] = np.mod(np.arctan2(y[j] - y[i], x[j] - x[i]), np.pi)
        pair[r0 : r0 + len(r)] = i * nc + j
    order = np.lexsort((pair, phi))
    pos = np.arange(m, dtype=np.int64)
    first = np.ones(m, dtype=bool)
    first[1:] = pair[order][1:] != pair[order][:-1]
    start = np.maximum.accumulate(np.where(first, pos, 0))  # each pair's first place in the angle order
    labels = np.empty(m, dtype=np.int32)
    labels[order] = (start * int(cfg.crystals_per_ring) // max(m, 1)) % subsets
    return labels


def scanner_of(src: Any) -> Any | None:
    """The :class:`~mlemlib.scanner.geometry.ScannerConfig` a matrix was generated for (its scanner block), or None."""
    from mlemlib.formats.csr4 import ScannerGeometry
    from mlemlib.scanner.geometry import Layer, ScannerConfig

    geometry = getattr(getattr(src, "header", None), "geometry", None)
    block = getattr(src, "scanner_block", None)
    if geometry is None and block:
        geometry = ScannerGeometry.from_bytes(bytes(block), getattr(src, "path", "<scanner block>"))
    if geometry is None or not geometry.layers:
        return None
    return ScannerConfig(
        name="", layers=tuple(Layer(*(float(v) for v in layer)) for layer in geometry.layers),
        n_blocks=int(geometry.n_blocks), block_size=int(geometry.block_size),
        block_gaps=tuple(float(v) for v in geometry.block_gaps), n_rings=int(geometry.n_rings),
        ring_gaps=tuple(float(v) for v in geometry.ring_gaps), voxel_size=tuple(geometry.voxel_size),
        grid=tuple(geometry.grid),
    )


def read_subset_file(path: str | os.PathLike, m: int, subsets: int) -> np.ndarray:
    """A user's subset file: one little-endian int32 per LOR, no header; checked by :func:`check_labels`."""
    p = os.fspath(path)
    if not os.path.isfile(p):
        raise ConfigError(p, "no such subset file")
    size = os.path.getsize(p)
    if size % 4:
        raise ConfigError(p, f"size {size} is not a multiple of 4 bytes (one int32 subset label per LOR)")
    return check_labels(np.fromfile(p, dtype="<i4"), m, subsets, p)


def labels_for(src: Any, subsets: int, *, subset_file: str | os.PathLike | None = None,
               name: str = "<matrix>") -> tuple[np.ndarray, str]:
    """Labels of the stored rows of a user's matrix (in its own row order, before any reorder), and the method.

    ``subset_file`` (one label per user LOR) wins; else the scanner's
    projection angles where the matrix carries a scanner block whose crystals
    make its LORs; else ``i mod S`` over the stored rows. A folded matrix's
    stored row takes its LORs' label: a file's must be one; by angle, a row that stands for LORs of
    several angles (a content fold) takes its first LOR's (:func:`mlemlib.corrections.stored_values`).
    """
    from mlemlib.corrections import stored_values
    from mlemlib.fold import fold_of

    subsets = check_count(subsets)
    fold = fold_of(src)
    m = int(src.shape[0])
    m_user = m if fold is None else fold.m_user
    if subset_file is not None:
        labels, method = read_subset_file(subset_file, m_user, subsets), "file"
        where = os.fspath(subset_file)
    else:
        cfg = scanner_of(src) if subsets > 1 else None
        if cfg is not None and int(cfg.n_crystals) ** 2 == m_user:
            labels, method, where = angle_labels(cfg, subsets), "angle", name
        else:
            return check_labels(index_labels(m, subsets), m, subsets, name), "index"
    if fold is not None:
        labels = stored_values(labels, fold, where, "subset label", first=method == "angle")
    return check_labels(labels, m, subsets, where), method


def labels_checksum(labels: np.ndarray) -> str:
    """blake2b-128 of the labels' little-endian int32 bytes (hex): which rows form which subset."""
    return hashlib.blake2b(np.ascontiguousarray(labels, dtype="<i4").tobytes(), digest_size=16).hexdigest()


def order(labels: np.ndarray, within: np.ndarray | None = None, subsets: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A stable row order grouping the subsets, and their bounds.

    Parameters
    ----------
    labels
        Subset of each row (int, ``[0, S)``).
    within
        A row order to keep inside each subset (``within[new] = old``, e.g. the
        locality order); default the rows' own order.
    subsets
        S (default ``labels.max() + 1``).

    Returns
    -------
    (rows, bounds)
        ``rows[new] = old`` (int64[m], subset-major) and int64[S+1]: subset
        ``k`` is rows ``[bounds[k], bounds[k+1])`` of the new order.
    """
    lab = np.asarray(labels, dtype=np.int64)
    base = np.arange(lab.size, dtype=np.int64) if within is None else np.asarray(within, dtype=np.int64)
    rows = base[np.argsort(lab[base], kind="stable")]
    s = int(lab.max()) + 1 if subsets is None else int(subsets)
    bounds = np.zeros(s + 1, dtype=np.int64)
    np.cumsum(np.bincount(lab, minlength=s), out=bounds[1:])
    return rows, bounds


def bounds_of(labels: np.ndarray, subsets: int, source: str | os.PathLike, hint: str = "") -> np.ndarray:
    """The bounds (int64[S+1]) of labels that are already grouped in row order (non-decreasing).

    Raises
    ------
    ConfigError
        Naming ``source``: the rows are not grouped by subset (``hint`` says what to do).
    """
    lab = np.asarray(labels, dtype=np.int64)
    if lab.size > 1 and (np.diff(lab) < 0).any():
        r = int(np.argmax(np.diff(lab) < 0)) + 1
        raise ConfigError(source, f"rows are not grouped by the {subsets} subsets (row {r} is in subset {int(lab[r])} "
                                  f"after subset {int(lab[r - 1])}){hint}")
    return order(lab, np.arange(lab.size), subsets)[1]


def check_bounds(bounds: Any, m: int, what: str = "subsets") -> np.ndarray:
    """``bounds`` as int64[S+1] from 0 to m, strictly increasing (no empty subset), or one line naming ``what``."""
    b = np.asarray(bounds).reshape(-1)
    if b.dtype.kind not in "iu" or b.size < 2 or int(b[0]) != 0 or int(b[-1]) != m or (np.diff(b) <= 0).any():
        raise ConfigError(what, f"subset bounds {b.tolist()[:8]}{'...' if b.size > 8 else ''} must rise strictly "
                                f"from 0 to m = {m}")
    return b.astype(np.int64)


def update_norms(sk: np.ndarray, dtype: Any = np.float32) -> np.ndarray:
    """What a backend's update divides by in sub-iteration k, from the float64 sensitivities ``sk`` (S x n).

    ``s^k_j`` rounded to ``dtype`` (float32 on the devices, float64 for the
    reference), NaN where ``s^k_j == 0 < s_j`` (the voxel is kept in that
    sub-iteration) and 0 where ``s_j == 0`` (the update is ``f_j * bp_j``,
    which is 0 there: no LOR sees the voxel). The update of every backend:
    ``f_j`` where NaN, else ``f_j * bp_j / norm_j`` (``f_j * bp_j`` where 0).
    """
    sk = np.asarray(sk, dtype=np.float64)
    if sk.ndim != 2:
        raise ConfigError("norm", f"per-subset sensitivities have shape {sk.shape}, expected (S, n)")
    seen = sk.sum(axis=0) > 0
    out = sk.astype(dtype)
    out[(out == 0) & (sk > 0)] = np.finfo(out.dtype).smallest_subnormal  # a positive s^k stays positive
    out[(sk == 0) & seen[None, :]] = np.nan
    return out


def sensitivities_of(norm: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The subsets' sensitivities ``s_k`` (S, n) back from the update norms (:func:`update_norms`'s (S, n), or
    S = 1's (n,) norm; NaN, a subset that does not see the voxel, as 0), their sum ``s`` and ``1 / s`` (0
    where ``s`` is 0), float64."""
    sk = np.asarray(norm, dtype=np.float64)
    sk = sk.reshape(1, -1) if sk.ndim == 1 else sk
    sk = np.where(np.isnan(sk), 0.0, sk)
    s = sk.sum(axis=0)
    return sk, s, np.divide(1.0, s, out=np.zeros_like(s), where=s > 0)
