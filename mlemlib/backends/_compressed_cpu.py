"""Numba CPU kernels on the compressed matrix and the one-pass MLEM iteration (host memory, float32).

The reference the CUDA kernels (``mlemlib/kernels/compressed.cu``) are tested
against; every kernel reads the encoded arrays of a
:class:`~mlemlib.compressed.CompressedMatrix` directly (no CSR copy), decoding
each row's column deltas as it goes.

- :func:`spmv` — ``y = A x`` (also the back projection ``A^T c`` on a stored
  compressed transpose: the same kernel on the encoding of ``A^T``). Each row
  is summed in order by one thread in float32, exactly as
  :func:`mlemlib.backends.cpu.spmv`: the results are bit-identical to the CSR
  kernel's on the same matrix (markers add nothing to the sum).
- :func:`spmv_t` — ``A^T c`` from the rows of ``A`` (no transpose), a scatter
  into one private image per row block, summed block after block:
  deterministic, no atomics, bit-identical to :func:`mlemlib.backends.cpu.spmv_t`
  with the same ``blocks``.
- :func:`onepass` (compressed) and :func:`csr_onepass` (CSR arrays) — the
  one-pass MLEM iteration: for each row ``fp_i = a_i . f``, ``c_i = g_i /
  fp_i`` (0 where ``fp_i == 0``, the division in float32 as the backends'
  ``correlate``), ``bp += c_i a_i``; one pass over ``A`` gives ``bp = A^T c``
  (and ``fp``). Row blocks and their summation are those of :func:`spmv_t`, so
  the result is bit-identical to ``spmv`` + correlate + ``spmv_t`` with the
  same ``blocks``.

16-bit values (``compressed-f16``, ``compressed-u16``) are decoded exactly
(``float32(half) * row scale``, ``float32(q) * row scale``); accumulation is
float32 throughout. Kernels take the encoded arrays as ``(rowbase, rowoff,
codes, vf, vb, scale, kind, high)`` (see
:func:`kernel_args`; ``codes`` uint8 or uint16, ``high`` the matrix's high
marker code, 254 or 65,534) and accept a row pointer that does not start at
slot 0. Markers and pads (the marker code with value bits 0) move the column
and add nothing.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from mlemlib._compressed_kernels import half_bits_to_float32
from mlemlib.compressed import CompressedMatrix, value_kind

#: Default number of row blocks of the scatters (as :data:`mlemlib.backends.cpu.DEFAULT_BLOCKS`).
DEFAULT_BLOCKS = 16


# --------------------------------------------------------------------------- decoding helpers
@njit(cache=True, nogil=True, inline="always")
def _rp(rowbase, rowoff, r):  # pragma: no cover - compiled
    return rowbase[r >> 6] + np.int64(rowoff[r])


@njit(cache=True, nogil=True, inline="always")
def _delta(cd, bits, high):  # pragma: no cover - compiled
    """Column delta of a slot with code ``cd`` and value bits ``bits`` (``high``: the high marker code)."""
    if cd < high:
        return np.int64(cd)
    if cd == high:
        return np.int64(bits) << 16
    return np.int64(bits)


@njit(cache=True, nogil=True, inline="always")
def _val(vf, vb, scale, kind, r, k):  # pragma: no cover - compiled
    """Value of slot ``k`` of row ``r``; ``kind`` as :data:`mlemlib.compressed.VALUE_KINDS`."""
    if kind == 1:
        return half_bits_to_float32(vb[k]) * scale[r]
    if kind == 2:
        return np.float32(vb[k]) * scale[r]
    return vf[k]


# --------------------------------------------------------------------------- kernels on the encoding
@njit(parallel=True, cache=True, nogil=True)
def cmp_spmv32(rowbase, rowoff, codes, vf, vb, scale, kind, high, x, y):  # pragma: no cover - compiled
    """``y[i] = sum_k a_ik x_k`` per row, in slot order, float32."""
    base = _rp(rowbase, rowoff, 0)
    for i in prange(y.shape[0]):
        s = _rp(rowbase, rowoff, i) - base
        e = _rp(rowbase, rowoff, i + 1) - base
        acc = np.float32(0.0)
        col = np.int64(0)
        for k in range(s, e):
            cd = codes[k]
            col += _delta(cd, vb[k], high)
            if cd < high:
                acc += _val(vf, vb, scale, kind, i, k) * np.float32(x[col])
        y[i] = acc


@njit(parallel=True, cache=True, nogil=True)
def cmp_spmv_t32(rowbase, rowoff, codes, vf, vb, scale, kind, high, c, out, partial):  # pragma: no cover - compiled
    """``out = A^T c`` by a scatter over row blocks (``partial``: blocks x n scratch), fixed-order sum."""
    nb = partial.shape[0]
    m = c.shape[0]
    n = out.shape[0]
    base = _rp(rowbase, rowoff, 0)
    for b in prange(nb):
        r0 = b * m // nb
        r1 = (b + 1) * m // nb
        p = partial[b]
        for j in range(n):
            p[j] = np.float32(0.0)
        for i in range(r0, r1):
            ci = np.float32(c[i])
            if ci != 0:
                col = np.int64(0)
                for k in range(_rp(rowbase, rowoff, i) - base, _rp(rowbase, rowoff, i + 1) - base):
                    cd = codes[k]
                    col += _delta(cd, vb[k], high)
                    if cd < high:
                        p[col] += _val(vf, vb, scale, kind, i, k) * ci
    for j in prange(n):
        s = np.float32(0.0)
        for b in range(nb):
            s += partial[b, j]
        out[j] = s


@njit(parallel=True, cache=True, nogil=True)
def cmp_onepass32(rowbase, rowoff, codes, vf, vb, scale, kind, high, g, f, fp, bp, partial, bg, has_bg):  # pragma: no cover
    """One-pass MLEM step on the encoding: ``fp = A f``, ``c = g / fp`` (``g / (fp + bg)`` with ``has_bg``),
    ``bp = A^T c``."""
    nb = partial.shape[0]
    m = g.shape[0]
    n = bp.shape[0]
    base = _rp(rowbase, rowoff, 0)
    for b in prange(nb):
        r0 = b * m // nb
        r1 = (b + 1) * m // nb
        p = partial[b]
        for j in range(n):
            p[j] = np.float32(0.0)
        for i in range(r0, r1):
            s = _rp(rowbase, rowoff, i) - base
            e = _rp(rowbase, rowoff, i + 1) - base
            acc = np.float32(0.0)
            col = np.int64(0)
            for k in range(s, e):
                cd = codes[k]
                col += _delta(cd, vb[k], high)
                if cd < high:
                    acc += _val(vf, vb, scale, kind, i, k) * np.float32(f[col])
            fp[i] = acc
            ci = np.float32(0.0)
            d = acc + bg[i] if has_bg else acc
            if d != 0:
                ci = np.float32(g[i]) / d
            if ci != 0:
                col = np.int64(0)
                for k in range(s, e):
                    cd = codes[k]
                    col += _delta(cd, vb[k], high)
                    if cd < high:
                        p[col] += _val(vf, vb, scale, kind, i, k) * ci
    for j in prange(n):
        t = np.float32(0.0)
        for b in range(nb):
            t += partial[b, j]
        bp[j] = t


@njit(parallel=True, cache=True, nogil=True)
def csr_onepass32(indptr, indices, data, g, f, fp, bp, partial, bg, has_bg):  # pragma: no cover - compiled
    """One-pass MLEM step on CSR arrays (``indptr`` may start anywhere); ``bg`` as :func:`cmp_onepass32`."""
    nb = partial.shape[0]
    m = g.shape[0]
    n = bp.shape[0]
    base = indptr[0]
    for b in prange(nb):
        r0 = b * m // nb
        r1 = (b + 1) * m // nb
        p = partial[b]
        for j in range(n):
            p[j] = np.float32(0.0)
        for i in range(r0, r1):
            s = indptr[i] - base
            e = indptr[i + 1] - base
            acc = np.float32(0.0)
            for k in range(s, e):
                acc += np.float32(data[k]) * np.float32(f[indices[k]])
            fp[i] = acc
            ci = np.float32(0.0)
            d = acc + bg[i] if has_bg else acc
            if d != 0:
                ci = np.float32(g[i]) / d
            if ci != 0:
                for k in range(s, e):
                    p[indices[k]] += np.float32(data[k]) * ci
    for j in prange(n):
        t = np.float32(0.0)
        for b in range(nb):
            t += partial[b, j]
        bp[j] = t


# --------------------------------------------------------------------------- wrappers
def kernel_args(a: CompressedMatrix) -> tuple:
    """``(rowbase, rowoff, codes, vf, vb, scale, kind, high)``: the encoded arrays as the kernels take them.

    ``codes`` is uint8 or uint16 (``a.code_bits``), ``vf`` the float32 value
    array (an empty array for 16-bit values), ``vb`` the value slots' bits
    (uint32 or uint16 view), ``scale`` the row scales (an empty array for
    float32 values), ``kind`` the value kind (0 float32, 1 float16, 2 uint16:
    :func:`mlemlib.compressed.value_kind`), ``high`` the high marker code
    (:func:`mlemlib.compressed.code_high`: 254 or 65,534).
    """
    kind = value_kind(a.values.dtype)
    half = kind != 0
    vf = a.values if not half else np.empty(0, dtype=np.float32)
    scale = a.scale if half else np.empty(0, dtype=np.float32)
    return (a.rowbase, a.rowoff, a.codes, vf, a.value_bits(), scale, np.int64(kind), np.int64(a.code_high))


def _vec(name: str, v: np.ndarray, size: int) -> np.ndarray:
    v = np.ascontiguousarray(np.asarray(v).reshape(-1), dtype=np.float32)
    if v.size != size:
        raise ValueError(f"{name} has {v.size} entries, expected {size}")
    return v


def _out(name: str, out: np.ndarray | None, size: int) -> np.ndarray:
    if out is None:
        return np.empty(size, dtype=np.float32)
    if out.dtype != np.float32 or out.shape != (size,) or not out.flags.c_contiguous:
        raise ValueError(f"{name} must be a contiguous float32 vector of {size} entries")
    return out


def _partial(partial: np.ndarray | None, blocks: int, n: int) -> np.ndarray:
    if partial is None:
        if blocks < 1:
            raise ValueError(f"blocks must be >= 1, got {blocks}")
        return np.empty((blocks, n), dtype=np.float32)
    if partial.dtype != np.float32 or partial.ndim != 2 or partial.shape[1] != n:
        raise ValueError(f"partial must be a float32 array of shape (blocks, {n})")
    return partial


def _background(background: np.ndarray | None, m: int) -> tuple[np.ndarray, bool]:
    """The one passes' ``(bg, has_bg)`` arguments: ``b'`` as float32[m], or a placeholder and False."""
    if background is None:
        return np.zeros(1, dtype=np.float32), False
    return _vec("background", background, m), True


def spmv(a: CompressedMatrix, x: np.ndarray, y: np.ndarray | None = None) -> np.ndarray:
    """``y = A x`` in float32 (``x``: n values; ``y``: m, allocated when None). Returns ``y``."""
    m, n = a.shape
    x = _vec("x", x, n)
    y = _out("y", y, m)
    cmp_spmv32(*kernel_args(a), x, y)
    return y


def spmv_t(
    a: CompressedMatrix,
    c: np.ndarray,
    out: np.ndarray | None = None,
    *,
    blocks: int = DEFAULT_BLOCKS,
    partial: np.ndarray | None = None,
) -> np.ndarray:
    """``out = A^T c`` by a blocked scatter from the rows of ``A`` (deterministic). Returns ``out``."""
    m, n = a.shape
    c = _vec("c", c, m)
    out = _out("out", out, n)
    cmp_spmv_t32(*kernel_args(a), c, out, _partial(partial, blocks, n))
    return out


def onepass(
    a: CompressedMatrix,
    g: np.ndarray,
    f: np.ndarray,
    *,
    bp: np.ndarray | None = None,
    fp: np.ndarray | None = None,
    blocks: int = DEFAULT_BLOCKS,
    partial: np.ndarray | None = None,
    background: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """One-pass MLEM step on a compressed matrix: ``fp = A f``, ``c = g / fp``, ``bp = A^T c``.

    Parameters
    ----------
    a
        The matrix (m x n).
    g
        Measurement, m values (cast to float32).
    f
        Image, n values (cast to float32).
    bp, fp
        Outputs (float32, n and m), allocated when None.
    blocks, partial
        Row blocks of the scatter and their ``(blocks, n)`` float32 scratch.
    background
        ``b'`` per row (float32, m) or None: ``c = g / (fp + b')``, 0 where that is 0
        (:mod:`mlemlib.backends.base`).

    Returns
    -------
    (bp, fp)
    """
    m, n = a.shape
    g = _vec("g", g, m)
    f = _vec("f", f, n)
    bp = _out("bp", bp, n)
    fp = _out("fp", fp, m)
    cmp_onepass32(*kernel_args(a), g, f, fp, bp, _partial(partial, blocks, n), *_background(background, m))
    return bp, fp


def csr_onepass(
    indptr: np.ndarray,
    indices: np.ndarray,
    data: np.ndarray,
    g: np.ndarray,
    f: np.ndarray,
    *,
    bp: np.ndarray | None = None,
    fp: np.ndarray | None = None,
    blocks: int = DEFAULT_BLOCKS,
    partial: np.ndarray | None = None,
    background: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """One-pass MLEM step on CSR arrays (int64 ``indptr``, int32 ``indices``, float32 ``data``); see :func:`onepass`."""
    m = len(indptr) - 1
    n = len(f)
    g = _vec("g", g, m)
    f = _vec("f", f, n)
    bp = _out("bp", bp, n)
    fp = _out("fp", fp, m)
    csr_onepass32(
        np.ascontiguousarray(indptr, dtype=np.int64),
        np.ascontiguousarray(indices, dtype=np.int32),
        np.ascontiguousarray(data, dtype=np.float32),
        g, f, fp, bp, _partial(partial, blocks, n), *_background(background, m),
    )
    return bp, fp
