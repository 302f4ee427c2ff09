"""Reader and writer of ``.LMsino`` measurement files (raw little-endian int32 counts); NumPy.

A ``.LMsino`` (or ``.sino``) file holds one int32 count per line of response
and nothing else: its length is the file size divided by 4 and must equal the
system matrix's number of rows.
"""

from __future__ import annotations

import os

import numpy as np

from mlemlib._io import atomic_path
from mlemlib.errors import SinogramFormatError

COUNT_DTYPE = np.dtype("<i4")


def read_lmsino(path: str | os.PathLike, expected_length: int | None = None) -> np.ndarray:
    """Read a ``.LMsino`` file as an int32 array, validated.

    Parameters
    ----------
    path
        The measurement file.
    expected_length
        The matrix's number of rows; ``None`` skips the length check.

    Returns
    -------
    numpy.ndarray
        int32 counts, one per LOR.

    Raises
    ------
    SinogramFormatError
        Missing file, a size that is not a multiple of 4, a length that differs
        from ``expected_length``, or negative counts.
    """
    source = os.fspath(path)
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise SinogramFormatError(source, "no such file") from None
    if os.path.isdir(path):
        raise SinogramFormatError(source, "is a directory, expected a .LMsino file")
    if size % 4:
        raise SinogramFormatError(
            source, f"file size {size} bytes is not a multiple of 4 (int32 counts); truncated or not a sinogram"
        )
    length = size // 4
    if expected_length is not None and length != int(expected_length):
        raise SinogramFormatError(
            source, f"sinogram has {length} counts but the matrix has {int(expected_length)} rows (LORs)"
        )
    counts = np.fromfile(path, dtype=COUNT_DTYPE)
    if len(counts) != length:  # file changed while reading
        raise SinogramFormatError(source, f"read {len(counts)} counts, expected {length}")
    if length and counts.min() < 0:
        bad = int(np.argmax(counts < 0))
        raise SinogramFormatError(source, f"negative count {int(counts[bad])} at LOR {bad}")
    return counts.astype(np.int32, copy=False)


def write_lmsino(path: str | os.PathLike, counts: np.ndarray) -> None:
    """Write counts as a ``.LMsino`` file (raw little-endian int32), atomically.

    Parameters
    ----------
    path
        Target file.
    counts
        1-D non-negative integer counts (an integer dtype, or floats holding
        whole numbers) that fit int32.

    Raises
    ------
    ValueError
        If ``counts`` is not 1-D, not whole, negative or too large for int32.
    """
    a = np.asarray(counts)
    if a.ndim != 1:
        raise ValueError(f"counts must be 1-D, got shape {a.shape}")
    if a.dtype.kind == "f":
        if not np.isfinite(a).all() or (a != np.floor(a)).any():
            raise ValueError("counts must be whole numbers")
    elif a.dtype.kind not in "iub":
        raise ValueError(f"counts must be integers, got dtype {a.dtype}")
    if a.size:
        lo, hi = a.min(), a.max()
        if lo < 0:
            raise ValueError(f"counts must be non-negative, found {lo}")
        if hi > np.iinfo(np.int32).max:
            raise ValueError(f"count {hi} does not fit int32")
    out = a.astype(COUNT_DTYPE)
    with atomic_path(path) as tmp:
        out.tofile(tmp)
