"""The locality permutation of a matrix: its type, its files, and the maps between user and permuted order (NumPy or CuPy).

Provides

- :class:`Permutation` — ``rows[new] = old`` (int64, m) and optionally
  ``voxels[new] = old`` (int64, n), tied to the matrix they were computed
  from by that matrix's container checksum; :func:`check_permutation`.
- :func:`write_permutation`, :func:`read_permutation` — a standalone
  ``perm.h5``; :func:`permutation_of` — the permutation stored in a reordered
  container (None for any other matrix); :func:`attach` — store one in a
  container being written. All validate: right lengths, each index exactly
  once, and (where given) the matrix the permutation belongs to.
- :func:`to_permuted_measurement`, :func:`measurement_to_user_order`,
  :func:`image_to_user_order`, :func:`image_to_permuted_order` — the maps
  between the user's order and the permuted space of a reconstruction (the
  result lives where the input lives).
- :func:`fingerprint` — the identity of a matrix a permutation belongs to.

Convention: row ``r'`` of the permuted matrix is row ``rows[r']`` of the
user's matrix; its column ``j'`` is the user's column ``voxels[j']``. So
``A' = A[rows][:, voxels]``, ``g' = g[rows]`` and ``f = f'`` scattered back
with ``f[voxels] = f'``. :mod:`mlemlib.ordering` computes a permutation,
:mod:`mlemlib.reorder` writes the permuted matrix.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlemlib.errors import ConfigError, MatrixFormatError
from mlemlib.matrix import CSRMatrix

log = logging.getLogger(__name__)

MODES = ("none", "rows", "rows+voxels")
#: The mode the workflow uses by default (docs/stages.md, "reorder", says why).
DEFAULT_MODE = "rows+voxels"

PERM_FORMAT = "mlem-permutation"
PERM_VERSION = 1
#: Attributes of a reordered matrix container (besides the container's own).
ATTR_MODE = "reorder_mode"
ATTR_SOURCE = "reorder_source"
ATTR_SOURCE_CHECKSUM = "reorder_source_checksum"
ATTR_PERM_CHECKSUM = "reorder_perm_checksum"
#: The subsets' row bounds of a permutation that groups the rows by OSEM subset, and how they were assigned.
SUBSET_DATASET = "subset_bounds"
ATTR_SUBSET_METHOD = "reorder_subset_method"
#: Default non-zeros per streamed chunk (as the other stages).
DEFAULT_CHUNK_NNZ = 1 << 26

# --------------------------------------------------------------------------- the permutation


@dataclass(frozen=True)
class Permutation:
    """Row and voxel permutations of one matrix.

    Attributes
    ----------
    rows
        int64[m]: new row ``r'`` is the user's row ``rows[r']``.
    voxels
        int64[n] or None (voxel order kept): new column ``j'`` is the user's column ``voxels[j']``.
    mode
        ``none``, ``rows`` or ``rows+voxels`` (what was asked; ``voxels`` is
        None also for ``rows+voxels`` on a matrix without a grid).
    shape, nnz
        Of the matrix.
    source_checksum
        The container checksum of the user's (unpermuted) matrix: the
        permutation belongs to that matrix only.
    subsets
        int64[S+1] or None: the rows are grouped by OSEM subset (subset-major,
        :func:`mlemlib.subsets.order`), subset ``k`` is new rows
        ``[subsets[k], subsets[k+1])``.
    subset_method
        How the subsets were assigned (:data:`mlemlib.subsets.METHODS`), ``""`` without subsets.
    """

    rows: np.ndarray
    voxels: np.ndarray | None
    mode: str
    shape: tuple[int, int]
    nnz: int
    source_checksum: str
    subsets: np.ndarray | None = None
    subset_method: str = ""

    @property
    def m(self) -> int:
        return int(self.shape[0])

    @property
    def n(self) -> int:
        return int(self.shape[1])

    def inverse_rows(self) -> np.ndarray:
        """int64[m]: ``inv[old] = new``."""
        return _inverse(self.rows)

    def inverse_voxels(self) -> np.ndarray | None:
        """int64[n] ``inv[old] = new``, or None when the voxel order is kept."""
        return None if self.voxels is None else _inverse(self.voxels)

    @property
    def checksum(self) -> str:
        """blake2b-256 of the little-endian int64 bytes of ``rows`` then ``voxels`` (if any), hex."""
        h = hashlib.blake2b(digest_size=32)
        h.update(np.ascontiguousarray(self.rows, dtype="<i8").tobytes())
        if self.voxels is not None:
            h.update(np.ascontiguousarray(self.voxels, dtype="<i8").tobytes())
        return h.hexdigest()

    def is_identity(self) -> bool:
        """True when neither rows nor voxels move."""
        ident = bool(np.array_equal(self.rows, np.arange(self.m)))
        return ident and (self.voxels is None or bool(np.array_equal(self.voxels, np.arange(self.n))))


def _inverse(p: np.ndarray) -> np.ndarray:
    inv = np.empty(len(p), dtype=np.int64)
    inv[p] = np.arange(len(p), dtype=np.int64)
    return inv


def check_permutation(p: Any, length: int, source: str | os.PathLike, what: str) -> np.ndarray:
    """``p`` as int64 after checking that it holds each of ``0 .. length-1`` exactly once.

    Raises
    ------
    MatrixFormatError
        Naming ``source`` and ``what``: not a 1-D integer array, the wrong
        length, an index out of range, or an index that repeats (and one that
        is missing).
    """
    a = np.asarray(p)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise MatrixFormatError(source, f"{what} is {a.dtype}{list(a.shape)}, expected a 1-D integer array")
    if a.shape[0] != length:
        raise MatrixFormatError(source, f"{what} has {a.shape[0]} entries, expected {length}")
    a = a.astype(np.int64, copy=False)
    if length == 0:
        return a
    lo, hi = int(a.min()), int(a.max())
    if lo < 0 or hi >= length:
        bad = lo if lo < 0 else hi
        raise MatrixFormatError(source, f"{what} holds index {bad}, outside [0, {length})")
    counts = np.bincount(a, minlength=length)
    if counts.max() > 1:
        dup = int(np.argmax(counts > 1))
        missing = int(np.argmax(counts == 0))
        raise MatrixFormatError(
            source, f"{what} is not a permutation: index {dup} appears {int(counts[dup])} times, {missing} never"
        )
    return a


def _check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ConfigError("reorder", f"mode {mode!r}, expected one of {', '.join(MODES)}")
    return mode


# --------------------------------------------------------------------------- sources


def _open(source: Any) -> tuple[Any, bool]:
    """An opened matrix (reader interface) and whether this call opened it."""
    if isinstance(source, (str, os.PathLike)):
        from mlemlib.formats.h5 import MatrixH5

        return MatrixH5(source), True
    if isinstance(source, CSRMatrix):
        from mlemlib.formats._memory import InMemoryMatrix

        return InMemoryMatrix(source, "<matrix in memory>"), True
    if hasattr(source, "iter_chunks") and hasattr(source, "shape"):
        return source, False
    raise ConfigError("matrix", f"expected a matrix container path, a CSRMatrix or an opened matrix, got {type(source).__name__}")


def _name(src: Any) -> str:
    return os.fspath(getattr(src, "source", None) or getattr(src, "path", None) or "<matrix>")


def fingerprint(source: Any) -> str:
    """The identity of a matrix: its container checksum (computed for an in-memory matrix)."""
    src, opened = _open(source)
    try:
        checksum = getattr(src, "checksum", None)
        if checksum:
            return str(checksum)
        matrix = getattr(src, "matrix", None)
        if isinstance(matrix, CSRMatrix):
            from mlemlib.formats.h5 import checksum_arrays

            return checksum_arrays(matrix.indptr, matrix.indices, matrix.data)
        raise ConfigError(_name(src), "no checksum to tie a permutation to: convert it first ('mlem convert')")
    finally:
        if opened:
            src.close()


def _already_reordered(src: Any) -> bool:
    attrs = getattr(src, "attrs", None) or {}
    return ATTR_MODE in attrs


def _progress(name: str, what: str, row: int, m: int, t0: float, done: int | None = None, total: int | None = None) -> None:
    """Log rows done and the ETA; ``done``/``total`` count the work of every pass (default ``row``/``m``)."""
    done, total = (row, m) if done is None or total is None else (done, total)
    el = time.perf_counter() - t0
    eta = el * (total - done) / done if done else float("nan")
    log.info("%s: %s rows up to %d of %d (%.0f%% of the work), ETA %.1f s", name, what, row, m, 100.0 * done / total, eta)


def _check_belongs(perm: Permutation, src: Any, name: str, perm_name: str) -> None:
    m, n = (int(v) for v in src.shape)
    if perm.shape != (m, n) or perm.nnz != int(src.nnz):
        raise MatrixFormatError(
            perm_name, f"permutation of another matrix ({perm.shape[0]} x {perm.shape[1]} with {perm.nnz} non-zeros, "
            f"{name} is {m} x {n} with {int(src.nnz)})"
        )
    checksum = fingerprint(src)
    if perm.source_checksum != checksum:
        raise MatrixFormatError(
            perm_name, f"permutation of another matrix (checksum {perm.source_checksum[:16]}..., "
            f"{name} has {checksum[:16]}...)"
        )



# --------------------------------------------------------------------------- files


def _is_container_format(fmt: Any) -> bool:
    """Whether ``fmt`` is the ``format`` attribute of a matrix container: CSR (``mlem reorder``) or compressed
    (``mlem generate --voxel-order hilbert``)."""
    from mlemlib.formats.compressed_h5 import FORMATS
    from mlemlib.formats.h5 import FORMAT

    return fmt == FORMAT or fmt in FORMATS


def _perm_datasets(perm: Permutation) -> dict[str, np.ndarray]:
    """The datasets that store ``perm`` in a file: ``row_perm`` and, if the voxels move, ``voxel_perm``."""
    out = {"row_perm": np.ascontiguousarray(perm.rows, dtype="<i8")}
    if perm.voxels is not None:
        out["voxel_perm"] = np.ascontiguousarray(perm.voxels, dtype="<i8")
    if perm.subsets is not None:
        out[SUBSET_DATASET] = np.ascontiguousarray(perm.subsets, dtype="<i8")
    return out


def _container_attrs(perm: Permutation, source: str) -> dict[str, str]:
    """The attributes that mark a matrix container as reordered by ``perm`` (``source``: the user's matrix)."""
    attrs = {ATTR_MODE: perm.mode, ATTR_SOURCE: source, ATTR_SOURCE_CHECKSUM: perm.source_checksum,
             ATTR_PERM_CHECKSUM: perm.checksum}
    if perm.subsets is not None:
        attrs[ATTR_SUBSET_METHOD] = perm.subset_method
    return attrs


def attach(writer: Any, perm: Permutation, source: str) -> None:
    """Store ``perm`` in a matrix container being written (before the writer closes): it then reads as
    reordered (:func:`permutation_of`), and runs on it are transparent."""
    writer.attach(_perm_datasets(perm), _container_attrs(perm, source))


def _write_perm_datasets(f: Any, perm: Permutation) -> None:
    for name, data in _perm_datasets(perm).items():
        f.create_dataset(name, data=data)


def write_permutation(path: str | os.PathLike, perm: Permutation, *, source: str = "") -> None:
    """Write a standalone ``perm.h5`` (atomically).

    Layout: ``/row_perm`` int64[m], optional ``/voxel_perm`` int64[n];
    attributes ``format="mlem-permutation"``, ``version=1``, ``mode``,
    ``shape`` (m, n), ``nnz``, ``source`` (the matrix's file name),
    ``source_checksum`` (its container checksum) and ``checksum`` (of the
    permutations, :attr:`Permutation.checksum`).
    """
    import h5py

    from mlemlib._io import atomic_path

    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        _write_perm_datasets(f, perm)
        f.attrs["format"] = PERM_FORMAT
        f.attrs["version"] = np.int64(PERM_VERSION)
        f.attrs["mode"] = perm.mode
        f.attrs["shape"] = np.array(perm.shape, dtype=np.int64)
        f.attrs["nnz"] = np.int64(perm.nnz)
        f.attrs["source"] = str(source)
        f.attrs["source_checksum"] = perm.source_checksum
        f.attrs["checksum"] = perm.checksum
        if perm.subsets is not None:
            f.attrs["subset_method"] = perm.subset_method


def _attr(f: Any, key: str, default: Any = None) -> Any:
    v = f.attrs.get(key, default)
    if isinstance(v, bytes):
        v = v.decode()
    if isinstance(v, np.ndarray):
        v = v.tolist()
    if isinstance(v, np.generic):
        v = v.item()
    return v


def _read_perm(f: Any, path: str, shape: tuple[int, int], mode: str, nnz: int, source_checksum: str, checksum: str) -> Permutation:
    import h5py

    m, n = shape
    if "row_perm" not in f or not isinstance(f["row_perm"], h5py.Dataset):
        raise MatrixFormatError(path, "no dataset 'row_perm' (a permutation written by 'mlem reorder')")
    rows = check_permutation(f["row_perm"][()], m, path, "row_perm")
    voxels = None
    if "voxel_perm" in f:
        if not isinstance(f["voxel_perm"], h5py.Dataset):
            raise MatrixFormatError(path, "'voxel_perm' is a group, expected a dataset")
        voxels = check_permutation(f["voxel_perm"][()], n, path, "voxel_perm")
    if mode not in MODES:
        raise MatrixFormatError(path, f"permutation mode {mode!r}, expected one of {', '.join(MODES)}")
    if mode != "rows+voxels" and voxels is not None:
        raise MatrixFormatError(path, f"mode {mode!r} but a voxel permutation is stored")
    subsets = None
    if SUBSET_DATASET in f:
        subsets = np.asarray(f[SUBSET_DATASET][()])
        if subsets.dtype.kind not in "iu" or subsets.ndim != 1 or subsets.size < 2 or int(subsets[0]) != 0 \
                or int(subsets[-1]) != m or (np.diff(subsets) <= 0).any():
            raise MatrixFormatError(path, f"{SUBSET_DATASET!r} must rise strictly from 0 to m = {m}")
        subsets = subsets.astype(np.int64)
    method = str(_attr(f, "subset_method", _attr(f, ATTR_SUBSET_METHOD, "")) or "")
    perm = Permutation(rows, voxels, mode, (m, n), nnz, source_checksum, subsets, method)
    if checksum and perm.checksum != checksum:
        raise MatrixFormatError(path, f"permutation checksum mismatch: attribute says {checksum[:16]}..., data gives {perm.checksum[:16]}... (file corrupted)")
    return perm


def read_permutation(
    path: str | os.PathLike,
    *,
    shape: tuple[int, int] | None = None,
    source_checksum: str | None = None,
) -> Permutation:
    """Read and validate a standalone ``perm.h5`` (or the permutation of a reordered container).

    Parameters
    ----------
    path
        The file.
    shape
        The matrix's ``(m, n)``: the permutations must have these lengths.
    source_checksum
        The matrix's container checksum: the permutation must belong to it.

    Raises
    ------
    MatrixFormatError
        One line naming ``path``: not HDF5, not a permutation file, a
        permutation of the wrong length, an index repeated or missing, a
        corrupt file, or a permutation of another matrix.
    """
    import h5py

    p = os.fspath(path)
    if not Path(p).is_file():
        raise MatrixFormatError(p, "no such permutation file")
    try:
        f = h5py.File(p, "r")
    except OSError as exc:
        raise MatrixFormatError(p, f"not a readable HDF5 file ({exc})") from None
    with f:
        fmt = _attr(f, "format")
        if fmt == PERM_FORMAT:
            version = _attr(f, "version")
            if version != PERM_VERSION:
                raise MatrixFormatError(p, f"unsupported permutation file version {version!r}, expected {PERM_VERSION}")
            stored = _attr(f, "shape")
            if not (isinstance(stored, list) and len(stored) == 2):
                raise MatrixFormatError(p, f"attribute shape is {stored!r}, expected (m, n)")
            mode, nnz = _attr(f, "mode"), int(_attr(f, "nnz", -1))
            src_ck, ck = str(_attr(f, "source_checksum", "")), str(_attr(f, "checksum", ""))
        elif _is_container_format(fmt) and ATTR_MODE in f.attrs:  # a reordered container (any matrix format)
            stored = _attr(f, "shape")
            mode, nnz = _attr(f, ATTR_MODE), int(_attr(f, "nnz", -1))
            src_ck, ck = str(_attr(f, ATTR_SOURCE_CHECKSUM, "")), str(_attr(f, ATTR_PERM_CHECKSUM, ""))
        else:
            raise MatrixFormatError(p, f"not a permutation file (attribute format is {fmt!r}, expected {PERM_FORMAT!r})")
        stored = (int(stored[0]), int(stored[1]))
        if shape is not None and tuple(int(v) for v in shape) != stored:
            raise MatrixFormatError(p, f"permutation of a {stored[0]} x {stored[1]} matrix, expected {shape[0]} x {shape[1]}")
        if source_checksum is not None and src_ck != source_checksum:
            raise MatrixFormatError(
                p, f"permutation of another matrix (checksum {src_ck[:16] or '(none)'}..., expected {source_checksum[:16]}...)"
            )
        return _read_perm(f, p, stored, mode, nnz, src_ck, ck)


def permutation_of(matrix: Any) -> Permutation | None:
    """The permutation stored in a reordered matrix container; None for any other matrix.

    Parameters
    ----------
    matrix
        A path, or an opened matrix (its ``path``/``source`` is used).
        Files that are not HDF5 containers (``.csr4``, ``.mtx``, ``.npz``) and
        in-memory matrices give None.

    Raises
    ------
    MatrixFormatError
        The container says it is reordered but its permutations are missing,
        of the wrong length, not permutations, or do not match their checksum.
    """
    from mlemlib.formats.h5 import marked_container

    path = marked_container(matrix, ATTR_MODE)
    return None if path is None else read_permutation(path)


# --------------------------------------------------------------------------- transparent MLEM


def _like(index: np.ndarray, a: Any) -> Any:
    """``index`` on the device of ``a`` (CuPy arrays get a CuPy index)."""
    if type(a).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy.asarray(index)
    return index


def _check_length(a: Any, length: int, what: str) -> None:
    if a.ndim != 1 or a.shape[0] != length:
        raise ConfigError(what, f"has shape {tuple(a.shape)}, expected a vector of {length} values")


def to_permuted_measurement(g_user: Any, perm: Permutation) -> Any:
    """The measurement in the permuted LOR order: ``g'[r'] = g[rows[r']]`` (NumPy or CuPy)."""
    _check_length(g_user, perm.m, "measurement")
    return g_user[_like(perm.rows, g_user)]


def measurement_to_user_order(y_perm: Any, perm: Permutation) -> Any:
    """An m-vector of the permuted space (e.g. a forward projection) in the user's LOR order."""
    _check_length(y_perm, perm.m, "m-vector")
    out = y_perm.copy()
    out[_like(perm.rows, y_perm)] = y_perm
    return out


def image_to_user_order(f_perm: Any, perm: Permutation) -> Any:
    """An image of the permuted space in the user's voxel order: ``f[voxels[j']] = f'[j']``.

    Returns ``f_perm`` itself when the voxel order is kept.
    """
    _check_length(f_perm, perm.n, "image")
    if perm.voxels is None:
        return f_perm
    out = f_perm.copy()
    out[_like(perm.voxels, f_perm)] = f_perm
    return out


def image_to_permuted_order(f_user: Any, perm: Permutation) -> Any:
    """A user-order image (truth, reference, initial image, norm) in the permuted voxel order: ``f'[j'] = f[voxels[j']]``."""
    _check_length(f_user, perm.n, "image")
    if perm.voxels is None:
        return f_user
    return f_user[_like(perm.voxels, f_user)]
