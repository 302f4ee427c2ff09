"""The Numba kernels of :mod:`mlemlib.compressed`: counting, encoding, checking and decoding rows.

Apart from that module so that importing it (every reader of a matrix file, the workflow's checks) does not
import Numba; :mod:`mlemlib.compressed` imports this module where a function runs a kernel.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange


@njit(cache=True, nogil=True, inline="always")
def half_bits_to_float32(h):  # pragma: no cover - compiled
    """The float32 value of IEEE binary16 bits ``h`` (exact)."""
    h = np.int64(h)
    e = (h >> 10) & 0x1F
    f = h & 0x3FF
    if e == 0:
        v = math.ldexp(np.float64(f), -24)
    elif e == 31:
        v = np.inf if f == 0 else np.nan
    else:
        v = math.ldexp(np.float64(f + 1024), int(e) - 25)
    if h & 0x8000:
        v = -v
    return np.float32(v)


@njit(parallel=True, cache=True, nogil=True)
def _count_markers(indptr, indices, half, markers8, markers16, unsorted):  # pragma: no cover - compiled
    """Markers each row needs with 8-bit and 16-bit codes (``half``: 16-bit value slots, any 16-bit format).

    ``unsorted[r]`` = 1 + position of a decreasing column, else 0.
    """
    m = markers8.shape[0]
    base = indptr[0]
    for r in prange(m):
        prev = np.int64(0)
        c8 = np.int64(0)
        c16 = np.int64(0)
        bad = np.int64(0)
        s = indptr[r] - base
        for k in range(s, indptr[r + 1] - base):
            c = np.int64(indices[k])
            d = c - prev
            if d < 0:
                if bad == 0:
                    bad = k - s + 1
            elif d > 253:
                extra = 1 if (half and d > 65535) else 0  # a high marker too
                c8 += 1 + extra
                if d > 65533:
                    c16 += 1 + extra
            prev = c
        markers8[r] = c8
        markers16[r] = c16
        unsorted[r] = bad


@njit(parallel=True, cache=True, nogil=True)
def _fill(indptr, indices, bits_in, slotptr, half, direct, high, mark, codes, bits_out):  # pragma: no cover
    """Write the codes and value slots of rows, pads included (``slotptr`` from the marker counts, from 0)."""
    m = slotptr.shape[0] - 1
    base = indptr[0]
    for r in prange(m):
        p = slotptr[r]
        prev = np.int64(0)
        for k in range(indptr[r] - base, indptr[r + 1] - base):
            c = np.int64(indices[k])
            d = c - prev
            prev = c
            if d <= direct:
                codes[p] = d
            else:
                if half and d > 65535:
                    codes[p] = high
                    bits_out[p] = d >> 16
                    p += 1
                    codes[p] = mark
                    bits_out[p] = d & 0xFFFF
                else:
                    codes[p] = mark
                    bits_out[p] = d
                p += 1
                codes[p] = 0
            bits_out[p] = bits_in[k]
            p += 1
        for q in range(p, slotptr[r + 1]):  # pads: markers of delta 0
            codes[q] = mark
            bits_out[q] = 0


@njit(parallel=True, cache=True, nogil=True)
def _row_scales(indptr, data, scale, out, fixed):  # pragma: no cover - compiled
    """Row scales (``scale``) and the values over them (``out``) of a 16-bit format.

    ``compressed-f16`` (``fixed`` False): the power of two that puts the
    row's largest value in ``[2**14, 2**15)``, and ``out`` (float64) the
    values over it. ``compressed-u16`` (``fixed`` True): ``float32(max /
    65535)`` (the smallest float32 where that rounds to 0), and ``out``
    (uint16, written on these threads: no float64 copy) the integers
    ``min(rint(v / scale), 65535)``. A row without a positive value has
    scale 1.
    """
    m = scale.shape[0]
    base = indptr[0]
    for r in prange(m):
        s = indptr[r] - base
        e = indptr[r + 1] - base
        vmax = np.float64(0.0)
        for k in range(s, e):
            vmax = max(vmax, np.float64(data[k]))
        sc = np.float32(1.0)
        if vmax > 0 and fixed:
            sc = max(np.float32(vmax / 65535.0), np.float32(math.ldexp(1.0, -149)))
        elif vmax > 0:
            _, ex = math.frexp(vmax)  # vmax < 2**ex
            sc = np.float32(math.ldexp(1.0, max(ex - 15, -149)))
        scale[r] = sc
        for k in range(s, e):
            v = np.float64(data[k]) / np.float64(sc)  # exact for a power of two
            if fixed:
                out[k] = min(np.rint(v), 65535.0)
            else:
                out[k] = v


@njit(parallel=True, cache=True, nogil=True)
def _first_bad_value(codes, bits, high, exp_mask, sign, nparts):  # pragma: no cover - compiled
    """The first slot holding an element (code below ``high``) whose value is NaN, infinite or below 0, else -1.

    On the value bits: an all-ones exponent (``exp_mask``) is NaN or
    infinity; the sign bit with any other bit set is a negative number (-0
    passes, as ``-0.0 >= 0``). Parallel over ``nparts`` pieces.
    """
    n = codes.shape[0]
    per = (n + nparts - 1) // nparts
    firsts = np.full(nparts, -1, dtype=np.int64)
    for p in prange(nparts):
        for k in range(p * per, min(n, (p + 1) * per)):
            if codes[k] < high:
                b = np.int64(bits[k])
                if (b & exp_mask) == exp_mask or ((b & sign) != 0 and (b & (sign - 1)) != 0):
                    firsts[p] = k
                    break
    for p in range(nparts):
        if firsts[p] >= 0:
            return firsts[p]
    return -1


@njit(parallel=True, cache=True, nogil=True)
def _real_counts(slotptr, codes, high, counts):  # pragma: no cover - compiled
    """Elements (slots that are not markers or pads) of each row."""
    m = counts.shape[0]
    base = slotptr[0]
    for r in prange(m):
        c = np.int64(0)
        for k in range(slotptr[r] - base, slotptr[r + 1] - base):
            if codes[k] < high:
                c += 1
        counts[r] = c


@njit(cache=True, nogil=True)
def _value16(kind, bits, scale):  # pragma: no cover - compiled
    """The float32 value of a 16-bit value slot (``kind`` 1: float16 bits, 2: an integer) times its row scale."""
    if kind == 1:
        return half_bits_to_float32(bits) * scale
    return np.float32(bits) * scale


@njit(parallel=True, cache=True, nogil=True)
def _decode(slotptr, codes, vf, vb, scale, kind, high, n, indptr, cols, vals, bad_slot, bad_col, store, counts):  # pragma: no cover
    """Decode rows into CSR arrays (``store``), or only walk them; a running column >= n stops the row and is reported.

    ``indptr`` (from :func:`_real_counts`) gives each row's output offset
    when ``store``; without it nothing is written but ``counts[r]``, the
    row's elements (slots that are not markers or pads), which the walk
    always fills. ``bad_slot[r]`` is 1 + the slot (within the row) where the
    running column left ``[0, n)`` (``bad_col[r]`` that column) or where a
    float32 row holds a high marker (``bad_col[r]`` = -1), both 0 for a good
    row. ``kind``: the values' kind (:data:`VALUE_KINDS`).
    """
    m = counts.shape[0]
    base = slotptr[0]
    for r in prange(m):
        q = indptr[r] if store else 0
        c = np.int64(0)
        col = np.int64(0)
        s = slotptr[r] - base
        bad_slot[r] = 0
        bad_col[r] = 0
        for k in range(s, slotptr[r + 1] - base):
            cd = codes[k]
            if cd < high:
                col += cd
            elif cd == high:
                if kind == 0:
                    bad_slot[r] = k - s + 1
                    bad_col[r] = -1
                    break
                col += np.int64(vb[k]) << 16
            else:
                col += np.int64(vb[k])
            if col >= n:
                bad_slot[r] = k - s + 1
                bad_col[r] = col
                break
            if cd < high:
                c += 1
                if store:
                    cols[q] = col
                    vals[q] = vf[k] if kind == 0 else _value16(kind, vb[k], scale[r])
                    q += 1
        counts[r] = c


@njit(parallel=True, cache=True, nogil=True)
def _slot_values(slotptr, codes, vb, scale, kind, high, indptr, vals):  # pragma: no cover - compiled
    """The elements' values alone (16-bit kinds), markers and pads skipped: row ``r``'s from
    ``indptr[r] - indptr[0]`` on: :func:`_value16`, as :func:`_decode`."""
    m = slotptr.shape[0] - 1
    base = slotptr[0]
    for r in prange(m):
        q = indptr[r] - indptr[0]
        for k in range(slotptr[r] - base, slotptr[r + 1] - base):
            if codes[k] < high:
                vals[q] = _value16(kind, vb[k], scale[r])
                q += 1
