"""The ``reorder`` stage: writes a matrix with its LORs (rows) and voxels (columns) renumbered, streaming (CPU; NumPy + Numba).

:mod:`mlemlib.ordering` computes the locality permutation, :mod:`mlemlib.permutation`
holds its type, files and the maps between the user's and the permuted order,
:mod:`mlemlib.locality` measures the gathers; this module writes the permuted
matrix and re-exports the public names of the three (``from mlemlib.reorder
import ...`` keeps working).

Provides

- :func:`apply` — writes the permuted matrix ``A[rows][:, voxels]`` with the
  permutations, in the source's format (CSR or a compressed format; the
  16-bit values and row scales of a lossy one move bit for bit, nothing is
  rounded again), streaming: the source is read in row chunks in file order
  and each row is copied to its new place in one output buffer (one copy of
  the matrix in host memory, or ``1/passes`` of it with several passes over
  the source).
- :func:`relabel_columns` — one row block with its columns renamed and each
  row sorted again (in memory).
- :func:`group_by_subsets` — a permutation made subset-major for OSEM (:mod:`mlemlib.subsets`).
- :func:`reorder_file` — the stage: compute (or read) the permutation and apply it.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
from numba import njit, prange

from mlemlib.errors import ConfigError, InputError
from mlemlib.locality import gather_locality, locality, voxel_reuse
from mlemlib.matrix import CSRMatrix
from mlemlib.ordering import (
    ROW_KEY_BITS,
    compute_permutation,
    hilbert_keys,
    transpose_row_order,
    voxel_permutation,
    voxel_row_order,
)
from mlemlib.permutation import (
    ATTR_MODE,
    ATTR_PERM_CHECKSUM,
    ATTR_SOURCE,
    ATTR_SOURCE_CHECKSUM,
    DEFAULT_CHUNK_NNZ,
    DEFAULT_MODE,
    MODES,
    PERM_FORMAT,
    PERM_VERSION,
    Permutation,
    _already_reordered,
    _check_belongs,
    _container_attrs,
    _inverse,  # noqa: F401  (importable from here as before)
    _name,
    _open,
    _progress,
    _write_perm_datasets,
    attach,
    check_permutation,
    fingerprint,
    image_to_permuted_order,
    image_to_user_order,
    measurement_to_user_order,
    permutation_of,
    read_permutation,
    to_permuted_measurement,
    write_permutation,
)

log = logging.getLogger(__name__)

__all__ = [
    "ATTR_MODE",
    "ATTR_PERM_CHECKSUM",
    "ATTR_SOURCE",
    "ATTR_SOURCE_CHECKSUM",
    "DEFAULT_CHUNK_NNZ",
    "DEFAULT_MODE",
    "MODES",
    "PERM_FORMAT",
    "PERM_VERSION",
    "ROW_KEY_BITS",
    "Permutation",
    "apply",
    "attach",
    "check_permutation",
    "compute_permutation",
    "fingerprint",
    "gather_locality",
    "group_by_subsets",
    "hilbert_keys",
    "image_to_permuted_order",
    "image_to_user_order",
    "locality",
    "measurement_to_user_order",
    "permutation_of",
    "read_permutation",
    "relabel_columns",
    "reorder_file",
    "to_permuted_measurement",
    "transpose_row_order",
    "voxel_permutation",
    "voxel_reuse",
    "voxel_row_order",
    "write_permutation",
]


@njit(parallel=True, cache=True)
def _scatter_rows(ip, idx, dat, r0, inv_rows, out_ip, lo_row, hi_row, base, vinv, relabel, out_idx, out_dat):  # pragma: no cover - compiled
    """Copy the rows of one source chunk to their new places in the output buffer.

    Source row ``r0 + i`` becomes row ``inv_rows[r0 + i]``; only rows in
    ``[lo_row, hi_row)`` (this pass) are copied, to ``out_ip[new] - base``.
    With ``relabel`` columns become ``vinv[col]`` and each row is sorted by
    column (stably: duplicates keep their order).
    """
    k = ip.shape[0] - 1
    for i in prange(k):
        new = inv_rows[r0 + i]
        if new < lo_row or new >= hi_row:
            continue
        a = ip[i]
        length = ip[i + 1] - a
        dst = out_ip[new] - base
        if relabel:
            cols = np.empty(length, np.int32)
            for t in range(length):
                cols[t] = vinv[idx[a + t]]
            order = np.argsort(cols, kind="mergesort")
            for t in range(length):
                out_idx[dst + t] = cols[order[t]]
                out_dat[dst + t] = dat[a + order[t]]
        else:
            for t in range(length):
                out_idx[dst + t] = idx[a + t]
                out_dat[dst + t] = dat[a + t]


def relabel_columns(block: CSRMatrix, vinv: np.ndarray) -> CSRMatrix:
    """``block`` with column ``c`` renamed ``vinv[c]`` and each row sorted by its new columns (stably).

    The voxel half of :func:`apply` for one row block in memory: with
    ``vinv = perm.inverse_voxels()`` the result is ``block[:, perm.voxels]``
    (all cores).
    """
    k = int(block.shape[0])
    ip = np.ascontiguousarray(block.indptr, dtype=np.int64)
    idx = np.empty_like(block.indices)
    dat = np.empty_like(block.data)
    if k:
        _scatter_rows(ip, block.indices, block.data, 0, np.arange(k, dtype=np.int64), ip, 0, k, 0,
                      np.ascontiguousarray(vinv, dtype=np.int64), True, idx, dat)
    return CSRMatrix(ip, idx, dat, block.shape)



def apply(
    source: Any,
    perm: Permutation | str | os.PathLike,
    out: str | os.PathLike,
    *,
    chunk_nnz: int = DEFAULT_CHUNK_NNZ,
    passes: int = 1,
    threads: int | None = None,
) -> dict[str, Any]:
    """Write the permuted matrix ``A[rows][:, voxels]`` as a container of the source's format, with its permutations.

    The source is read in row chunks in file order (``passes`` times); each
    row is copied to its new place in an output buffer that holds the rows of
    one pass (``1/passes`` of the matrix: a column and a value per non-zero,
    8 bytes, or 6 for the 16-bit formats), which is then written in row
    blocks. With a voxel permutation every row's columns are relabelled and
    sorted (duplicates keep their order); without one, rows are copied
    verbatim.

    The output has the source's format: a CSR container, or a compressed one
    of the same variant. A compressed row moves as its columns, the stored
    value bits of its elements and its row scale, and is encoded again from
    them (:meth:`~mlemlib.formats.compressed_h5.CompressedH5Writer.write_element_bits`):
    the 16-bit values of ``compressed-f16``/``-u16`` are not rounded again, so
    the output decodes to exactly the permuted decoded source, and equals the
    conversion of the permuted source matrix when the code width is the same.
    The code width is the source's when the voxels keep their order (each row's
    encoding is unchanged), else the smaller encoding of the first pass's rows.

    The output (written atomically) carries the source's grid, voxel size,
    scanner block and attributes, plus ``reorder_mode``, ``reorder_source``,
    ``reorder_source_checksum``, ``reorder_perm_checksum``, and datasets
    ``/row_perm`` (int64[m]) and, if the voxels move, ``/voxel_perm``
    (int64[n]); a folded source's row map comes along unchanged.

    Parameters
    ----------
    source
        The user's matrix: a container path, an opened matrix or a CSRMatrix.
    perm
        A :class:`Permutation` or a ``perm.h5`` path; it must belong to
        ``source`` (same shape, nnz and checksum).
    out
        The container to write.
    chunk_nnz
        Non-zeros (slots, for a compressed source) per streamed chunk (read) and per written block.
    passes
        Passes over the source; the output buffer holds ``1/passes`` of the matrix.
    threads
        Numba threads (None: all).

    Returns
    -------
    dict
        ``out``, ``shape``, ``nnz``, ``format``, ``mode``, ``voxels_permuted``,
        ``checksum`` (of the output), ``source_checksum``, ``perm_checksum``,
        ``passes``, ``seconds``.

    Raises
    ------
    MatrixFormatError
        A corrupt source, or a permutation (file) that is not a permutation of
        the right length or belongs to another matrix.
    ConfigError
        A bad chunk size or pass count.
    """
    import h5py

    from mlemlib._io import atomic_path
    from mlemlib.formats.compressed_h5 import RESERVED as COMPRESSED_RESERVED
    from mlemlib.formats.compressed_h5 import CompressedH5, CompressedH5Writer
    from mlemlib.formats.h5 import FOLD_ATTR_USER_ROWS, FOLD_DATASET, RESERVED_ATTRS, MatrixH5Writer, marked_container
    from mlemlib.transpose import numba_threads

    for key, value in (("chunk_nnz", chunk_nnz), ("passes", passes)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ConfigError(key, f"{value!r} is not a positive integer")
    t_start = time.perf_counter()
    src, opened = _open(source)
    try:
        name = _name(src)
        if _already_reordered(src):
            raise InputError(name, "is already a reordered matrix; reorder the user's matrix (from 'mlem convert')")
        m, n = (int(v) for v in src.shape)
        if isinstance(perm, (str, os.PathLike)):
            perm_name = os.fspath(perm)
            perm = read_permutation(perm, shape=(m, n))
        else:
            perm_name = "<permutation>"
            check_permutation(perm.rows, m, perm_name, "row permutation")
            if perm.voxels is not None:
                check_permutation(perm.voxels, n, perm_name, "voxel permutation")
        _check_belongs(perm, src, name, perm_name)
        compressed = isinstance(src, CompressedH5)
        fmt = src.format if compressed else "csr"
        # a folded source stays folded: its rows are permuted, its map (validated when read) is not
        folded = marked_container(src, FOLD_ATTR_USER_ROWS)
        row_map = None
        if folded is not None:
            with h5py.File(folded, "r") as f:
                row_map = f[FOLD_DATASET][()] if FOLD_DATASET in f else None
        nnz = int(src.nnz)
        lengths = np.diff(src.read_indptr())
        out_ip = np.zeros(m + 1, dtype=np.int64)
        np.cumsum(lengths[perm.rows], out=out_ip[1:])
        inv_rows = perm.inverse_rows()
        vinv = perm.inverse_voxels()
        relabel = vinv is not None
        vinv_arr = vinv.astype(np.int32) if relabel else np.zeros(1, np.int32)
        scale = src.read_scale(0, m) if compressed else None
        out_scale = scale[perm.rows] if scale is not None else None
        del scale
        # pass s writes output rows [b[s], b[s+1]), about nnz/passes non-zeros each
        targets = [-(-s * nnz // passes) for s in range(passes + 1)]
        bounds = [int(np.searchsorted(out_ip, t, side="left")) for t in targets]
        bounds[0], bounds[-1] = 0, m
        reserved = COMPRESSED_RESERVED if compressed else RESERVED_ATTRS
        attrs = {
            k: v for k, v in (getattr(src, "attrs", None) or {}).items()
            if k not in reserved and not k.startswith("reorder_") and isinstance(v, (str, int, float, list))
        }
        attrs.update(_container_attrs(perm, Path(name).name))
        geometry = {
            "source": Path(name).name, "grid": getattr(src, "grid", None),
            "voxel_size": getattr(src, "voxel_size", None), "scanner_block": getattr(src, "scanner_block", None),
        }
        log.info(
            "%s: writing %s permutation (%d x %d, %d non-zeros, %s) to %s in %d pass(es)",
            name, perm.mode, m, n, nnz, fmt, out, passes,
        )
        t0 = time.perf_counter()
        total = passes * m
        with atomic_path(out) as tmp:
            if compressed:
                # the rows' encodings are unchanged when only rows move: the source's width stays the best
                writer = CompressedH5Writer(tmp, (m, n), nnz, fmt=fmt, code_bits=None if relabel else src.code_bits,
                                            **geometry, **attrs)
            else:
                writer = MatrixH5Writer(tmp, (m, n), nnz, **geometry, **attrs)
            with writer as w, numba_threads(threads):
                next_report = 0.1
                for s in range(passes):
                    lo_row, hi_row = bounds[s], bounds[s + 1]
                    base, top = int(out_ip[lo_row]), int(out_ip[hi_row])
                    out_idx = np.empty(top - base, dtype=np.int32)
                    out_dat = None
                    for r0, r1, ip, idx, dat in _source_rows(src, chunk_nnz, compressed):
                        if out_dat is None:
                            out_dat = np.empty(top - base, dtype=dat.dtype)
                        if r1 > r0 and hi_row > lo_row:
                            _scatter_rows(
                                ip, idx, dat, np.int64(r0), inv_rows, out_ip, np.int64(lo_row),
                                np.int64(hi_row), np.int64(base), vinv_arr, relabel, out_idx, out_dat,
                            )
                        done = s * m + r1
                        if total and done / total >= next_report:
                            _progress(name, f"pass {s + 1}/{passes}: permuted", r1, m, t0, done, total)
                            next_report = done / total + 0.1
                    if out_dat is None:  # no rows at all
                        out_dat = np.empty(0, dtype=np.float32)
                    if compressed and w.code_bits is None:
                        w.set_code_bits(_smaller_code_bits(out_ip[lo_row : hi_row + 1] - base, out_idx, n, fmt))
                    r = lo_row
                    while r < hi_row:
                        r_end = int(np.searchsorted(out_ip, int(out_ip[r]) + chunk_nnz, side="right")) - 1
                        r_end = min(max(r_end, r + 1), hi_row)
                        a, b = int(out_ip[r]) - base, int(out_ip[r_end]) - base
                        ip = out_ip[r : r_end + 1] - out_ip[r]
                        if compressed:
                            w.write_element_bits(ip, out_idx[a:b], out_dat[a:b],
                                                 out_scale[r:r_end] if out_scale is not None else None)
                        else:
                            w.write_rows(CSRMatrix(ip, out_idx[a:b], out_dat[a:b], (r_end - r, n)))
                        r = r_end
                    del out_idx, out_dat
            with h5py.File(tmp, "a") as f:
                _write_perm_datasets(f, perm)
                if row_map is not None:  # the source's fold (its attributes came with the others)
                    f.create_dataset(FOLD_DATASET, data=np.ascontiguousarray(row_map, dtype="<i8"))
        seconds = time.perf_counter() - t_start
        log.info("%s: wrote %s (%.2f s)", name, out, seconds)
        return {
            "out": os.fspath(out),
            "shape": [m, n],
            "nnz": nnz,
            "format": fmt,
            "mode": perm.mode,
            "voxels_permuted": perm.voxels is not None,
            "checksum": w.checksum,
            "source_checksum": perm.source_checksum,
            "perm_checksum": perm.checksum,
            "passes": passes,
            "subsets": None if perm.subsets is None else len(perm.subsets) - 1,
            "seconds": seconds,
        }
    finally:
        if opened:
            src.close()


def _source_rows(src: Any, chunk_nnz: int, compressed: bool):
    """``(r0, r1, indptr from 0, columns, values)`` of the source's row chunks in file order; the values of a
    compressed source are its elements' stored value bits (uint32 or uint16)."""
    if compressed:
        for r0, r1, rows in src.iter_element_bits(chunk_nnz):
            yield r0, r1, rows.csr.indptr, rows.csr.indices, rows.bits
    else:
        for r0, r1, block in src.iter_chunks(max_nnz=chunk_nnz):
            yield r0, r1, block.indptr - block.indptr[0], block.indices, block.data


def _smaller_code_bits(indptr: np.ndarray, indices: np.ndarray, n: int, fmt: str) -> int:
    """The code width (8 or 16) whose encoding of these rows is smaller (markers and pads counted)."""
    from mlemlib.compressed import choose_code_bits

    # only the row pointer and the columns decide the encoded size: no values are passed
    return choose_code_bits(CSRMatrix(indptr, indices, np.empty(0, dtype=np.float32), (len(indptr) - 1, n)), fmt)


def reorder_file(
    matrix: str | os.PathLike,
    out: str | os.PathLike,
    mode: str = DEFAULT_MODE,
    *,
    perm: str | os.PathLike | None = None,
    perm_out: str | os.PathLike | None = None,
    chunk_nnz: int = DEFAULT_CHUNK_NNZ,
    passes: int = 1,
    threads: int | None = None,
    subsets: int = 1,
    subset_file: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """The ``reorder`` stage: compute the permutation of ``matrix`` (or read ``perm``) and write the permuted container.

    Parameters
    ----------
    matrix
        The user's matrix container (from ``mlem convert``).
    out
        The reordered container to write.
    mode
        ``none``, ``rows`` or ``rows+voxels`` (ignored when ``perm`` is given).
    perm
        A ``perm.h5`` to apply instead of computing one; it must belong to ``matrix``.
    perm_out
        Also write the permutation alone to this ``perm.h5``.
    chunk_nnz, passes, threads
        See :func:`compute_permutation` and :func:`apply`.
    subsets, subset_file
        OSEM subsets (S > 1 or a subset file): rows grouped by subset, the locality order inside
        each (:func:`group_by_subsets`); the container records the bounds (``/subset_bounds``).

    Returns
    -------
    dict
        :func:`apply`'s summary plus ``permutation_s`` (computing the permutation).
    """
    from mlemlib.formats.h5 import MatrixH5

    with MatrixH5(matrix) as src:
        t0 = time.perf_counter()
        if perm is not None:
            p = read_permutation(perm, shape=src.shape)
            _check_belongs(p, src, os.fspath(matrix), os.fspath(perm))
        else:
            p = group_by_subsets(compute_permutation(src, mode, chunk_nnz=chunk_nnz, threads=threads), src,
                                 subsets, subset_file)
        t_perm = time.perf_counter() - t0
        if perm_out is not None:
            write_permutation(perm_out, p, source=Path(matrix).name)
        summary = apply(src, p, out, chunk_nnz=chunk_nnz, passes=passes, threads=threads)
    summary["permutation_s"] = t_perm
    return summary


def group_by_subsets(perm: Permutation, src: Any, subsets: int,
                     subset_file: str | os.PathLike | None = None) -> Permutation:
    """``perm`` with its rows grouped by OSEM subset, its order kept inside each, and the subsets' bounds.

    ``src`` is the user's (opened) matrix ``perm`` belongs to; the labels are
    :func:`mlemlib.subsets.labels_for`'s. S = 1 without a subset file returns ``perm``.
    """
    import dataclasses

    from mlemlib.subsets import check_count, labels_for, order

    subsets = check_count(subsets)
    if subsets == 1 and subset_file is None:
        return perm
    labels, method = labels_for(src, subsets, subset_file=subset_file, name=_name(src))
    rows, bounds = order(labels, perm.rows, subsets)
    log.info("%s: rows grouped into %d subsets (%s), %d to %d rows each", _name(src), subsets, method,
             int(np.diff(bounds).min()), int(np.diff(bounds).max()))
    return dataclasses.replace(perm, rows=rows, subsets=bounds, subset_method=method)
