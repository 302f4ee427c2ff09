"""Reader and writer of ``.LMsino`` measurement files (raw little-endian int32 counts); NumPy.

A ``.LMsino`` (or ``.sino``) file holds one int32 count per line of response
and nothing else: its length is the file size divided by 4 and must equal the
system matrix's number of rows.

A file of float32 values has the same size, and read as int32 its counts are
around 1e9 (the bit patterns of floats): :func:`read_lmsino` refuses a file
whose non-zero values all lie beyond 2^24 in magnitude while its bytes read as
float32 are all finite and between 1e-10 and 2^31 in magnitude (see
:func:`looks_like_float32`).
"""

from __future__ import annotations

import os

import numpy as np

from mlemlib._io import atomic_path
from mlemlib.errors import SinogramFormatError

COUNT_DTYPE = np.dtype("<i4")

#: Counts per LOR that no PET measurement reaches (2^24: also where float32 stops holding every integer).
MAX_PLAUSIBLE_COUNT = 1 << 24
#: The magnitudes a float32 measurement holds (expected counts from 1e-10 to 2^31); read as int32 their bit
#: patterns lie between about 7.9e8 and 1.3e9, far beyond :data:`MAX_PLAUSIBLE_COUNT`.
FLOAT_COUNT_RANGE = (1e-10, 2.0**31)


def looks_like_float32(counts: np.ndarray) -> tuple[float, float] | None:
    """Whether int32 ``counts`` are the bytes of float32 values: the floats' magnitude range, else None.

    True when every non-zero value lies beyond :data:`MAX_PLAUSIBLE_COUNT` in
    magnitude (no real PET count does: a LOR collects at most thousands of
    counts, millions for a whole-scan sum, and float32 holds every integer only
    up to 2^24), and the same bytes read as float32 are all finite with their
    non-zero magnitudes within :data:`FLOAT_COUNT_RANGE`. A file of int32
    counts passes both only if every counted LOR holds between about 7.9e8 and
    1.3e9 counts.
    """
    c = np.asarray(counts, dtype=COUNT_DTYPE)
    nonzero = c != 0
    if not nonzero.any():
        return None
    big = MAX_PLAUSIBLE_COUNT
    if np.min(c, where=c > 0, initial=np.iinfo(np.int32).max) <= big or np.max(c, where=c < 0, initial=-big - 1) >= -big:
        return None
    f = c.view("<f4")
    if not np.isfinite(f).all():
        return None
    mag = np.abs(f)
    lo = float(np.min(mag, where=nonzero, initial=np.inf))
    hi = float(np.max(mag, where=nonzero, initial=0.0))
    if lo < FLOAT_COUNT_RANGE[0] or hi > FLOAT_COUNT_RANGE[1]:
        return None
    return lo, hi


def _float_hint(source: str) -> str:
    """How to turn a float32 measurement into int32 counts (one line)."""
    return (
        f"convert with: python -c \"import numpy as np; np.rint(np.fromfile('{source}', '<f4'))"
        f".astype('<i4').tofile('counts.LMsino')\""
    )


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
        from ``expected_length``, negative counts, or float32 values
        (:func:`looks_like_float32`).
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
    floats = looks_like_float32(counts) if length else None
    if length and counts.min() < 0:
        bad = int(np.argmax(counts < 0))
        if floats is not None:
            value = float(counts[bad : bad + 1].view("<f4")[0])
            raise SinogramFormatError(
                source, f"looks like float32 values, not int32 counts, and holds a negative value ({value:g} at LOR "
                f"{bad}): a measurement holds non-negative counts"
            )
        raise SinogramFormatError(source, f"negative count {int(counts[bad])} at LOR {bad}")
    if floats is not None:
        raise SinogramFormatError(
            source, f"looks like float32 counts, not int32 (read as int32 every non-zero count is above 2^24; "
            f"read as float32 they run from {floats[0]:.4g} to {floats[1]:.4g}): {_float_hint(source)}"
        )
    return counts.astype(np.int32, copy=False)


def check_counts(g: np.ndarray, source: str | os.PathLike) -> np.ndarray:
    """Check a measurement given as an array (integer counts or float expected counts): finite, non-negative.

    Returns ``g`` flat; raises :class:`SinogramFormatError` naming ``source``
    and the first bad value's LOR.
    """
    g = np.asarray(g).reshape(-1)
    if g.dtype.kind not in "iufb":
        raise SinogramFormatError(source, f"a measurement holds numbers, got dtype {g.dtype}")
    if g.dtype.kind == "f":
        finite = np.isfinite(g)
        if not finite.all():
            bad = int(np.argmin(finite))
            raise SinogramFormatError(source, f"non-finite count {g[bad]} at LOR {bad}")
    if g.size and g.min() < 0:
        bad = int(np.argmax(g < 0))
        raise SinogramFormatError(source, f"negative count {g[bad]:g} at LOR {bad}")
    return g


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
