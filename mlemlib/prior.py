"""Priors of MAP reconstruction: the relative difference prior and the quadratic prior (CPU: NumPy + Numba; CUDA: CuPy).

Provides

- :class:`Prior` (built by :func:`make_prior`) — the penalty
  ``R(f) = sum over unordered 26-neighbour pairs {j, k} of kappa_j kappa_k w_jk phi(f_j, f_k)``
  on an image grid, with ``w_jk = 1 / distance`` in voxel units (1, 1/sqrt(2),
  1/sqrt(3)) and, for the relative difference prior (``rdp``),
  ``phi(a, b) = (a - b)^2 / (a + b + gamma |a - b| + epsilon)``, for the
  quadratic prior (``quadratic``) ``phi(a, b) = (a - b)^2 / 2``. Its methods
  :meth:`Prior.value` (``R``, accumulated in float64), :meth:`Prior.gradient`
  (``dR/df``) and :meth:`Prior.curvature` (the diagonal of the Hessian of
  ``R``, for a preconditioner) work in the image's namespace: a NumPy image
  runs the Numba stencil, a CuPy image the CUDA one
  (``mlemlib/kernels/prior.cu``, through :mod:`mlemlib._prior_cuda`).
- :func:`neighbour_offsets` — the 26 offsets, the 13 of each unordered pair
  first; :func:`neighbour_pairs` — every pair of a grid as arrays (for tests and
  the float64 reference, :mod:`mlemlib.map_reference`).
- :func:`read_kappa` (:func:`check_kappa`) — the per-voxel weights from a raw
  float32 file or ``file.h5:/dataset``; :func:`require_grid` — a matrix's
  voxel grid, or one line saying how to give it one; :func:`given_geometry`
  (:func:`check_grid`) — the grid ``mlem convert --grid`` records, checked.

Voxel order. The grid's voxel ``j = x + nx*(y + ny*z)`` (x fastest) is the
user's order. A matrix reordered with a voxel permutation
(:class:`mlemlib.permutation.Permutation`, ``voxels[j'] = j``: stored column
``j'`` is the user's voxel ``voxels[j']``) is reconstructed in the stored
order; a prior made with that ``voxels`` takes and returns images in the
stored order while acting on the user's grid: each stored voxel's user index
and each user voxel's stored index are kept (two int64 n-vectors) and the
stencil gathers the neighbours through them, so no image is copied. ``kappa``
is given in the user's order and kept in the stored one.

Arithmetic. Every term is computed in float64 (the image's values are widened
as they are read) and the gradient and curvature are rounded to the image's
dtype once per voxel; ``R`` is summed in float64 over fixed blocks of voxels,
the blocks then in order, so that the results do not depend on the number of
threads. Each voxel's gradient is a gather over its own 26 neighbours in a
fixed order: no atomics, bit-identical run after run. Widened to float64,
even a subnormal float32 value is a normal number, and so are the squares and
products of the terms: no loop here slows down on subnormals.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numba import njit, prange

from mlemlib.errors import ConfigError, MatrixFormatError
from mlemlib.grid import check_grid, given_geometry

#: Prior types and the codes the kernels use for them.
KINDS = {"rdp": 0, "quadratic": 1}
#: Default ``gamma`` of the relative difference prior (STIR's and the PETRIC challenge's value).
DEFAULT_GAMMA = 2.0
#: Voxels per block of the value's float64 sum (fixed, so the sum does not depend on the thread count).
VALUE_BLOCK = 4096


def neighbour_offsets() -> tuple[np.ndarray, np.ndarray]:
    """The 26 neighbour offsets and their weights.

    Returns
    -------
    (numpy.ndarray, numpy.ndarray)
        int64[26, 3] offsets ``(dx, dy, dz)`` and float64[26] weights
        ``1 / sqrt(dx^2 + dy^2 + dz^2)``. Rows 0..12 are the offsets whose
        linear offset ``dx + nx*(dy + ny*dz)`` is positive (``dz > 0``, or
        ``dz == 0`` and ``dy > 0``, or ``dz == dy == 0`` and ``dx > 0``), one per
        unordered pair; row ``13 + i`` is minus row ``i``.
    """
    fwd = [(dx, dy, dz) for dz in (-1, 0, 1) for dy in (-1, 0, 1) for dx in (-1, 0, 1)
           if (dz, dy, dx) > (0, 0, 0)]  # fmt: skip
    off = np.array(fwd + [(-dx, -dy, -dz) for dx, dy, dz in fwd], dtype=np.int64)
    w = 1.0 / np.sqrt((off.astype(np.float64) ** 2).sum(axis=1))
    return off, w


_OFF, _W = neighbour_offsets()
_OX, _OY, _OZ = (np.ascontiguousarray(_OFF[:, i]) for i in range(3))


def neighbour_pairs(grid: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every unordered 26-neighbour pair of a grid once, in the user's voxel order.

    Parameters
    ----------
    grid
        ``(nx, ny, nz)``.

    Returns
    -------
    (numpy.ndarray, numpy.ndarray, numpy.ndarray)
        ``j`` int64, ``k`` int64 (``k > j``) and ``w`` float64 (``1 / distance``), one entry per pair.
    """
    nx, ny, nz = (int(v) for v in grid)
    x, y, z = np.meshgrid(np.arange(nx), np.arange(ny), np.arange(nz), indexing="ij")
    x, y, z = x.ravel(), y.ravel(), z.ravel()
    js, ks, ws = [], [], []
    for (dx, dy, dz), w in zip(_OFF[:13], _W[:13]):
        xx, yy, zz = x + dx, y + dy, z + dz
        inside = (xx >= 0) & (xx < nx) & (yy >= 0) & (yy < ny) & (zz >= 0) & (zz < nz)
        j = x[inside] + nx * (y[inside] + ny * z[inside])
        js.append(j)
        ks.append(xx[inside] + nx * (yy[inside] + ny * zz[inside]))
        ws.append(np.full(j.size, w))
    return (np.concatenate(js).astype(np.int64), np.concatenate(ks).astype(np.int64), np.concatenate(ws))


# --------------------------------------------------------------------------- the pair terms (float64)


@njit(cache=True, inline="always")
def _phi(a: float, b: float, kind: int, gamma: float, eps: float) -> float:
    d = a - b
    if kind == 1:
        return 0.5 * d * d
    return d * d / (a + b + gamma * abs(d) + eps)


@njit(cache=True, inline="always")
def _dphi(a: float, b: float, kind: int, gamma: float, eps: float) -> float:
    """d phi(a, b) / da; for the RDP ``d (a + 3b + gamma |d| + 2 eps) / D^2`` with ``D`` the denominator."""
    d = a - b
    if kind == 1:
        return d
    den = a + b + gamma * abs(d) + eps
    return d * (a + 3.0 * b + gamma * abs(d) + 2.0 * eps) / (den * den)


@njit(cache=True, inline="always")
def _d2phi(a: float, b: float, kind: int, gamma: float, eps: float) -> float:
    """d^2 phi(a, b) / da^2; for the RDP ``2/D - 2 d N (1 + gamma sign d) / D^3`` (``N`` the numerator of dphi)."""
    if kind == 1:
        return 1.0
    d = a - b
    den = a + b + gamma * abs(d) + eps
    num = a + 3.0 * b + gamma * abs(d) + 2.0 * eps
    sgn = 1.0 if d > 0 else (-1.0 if d < 0 else 0.0)
    return 2.0 / den - 2.0 * d * num * (1.0 + gamma * sgn) / (den * den * den)


@njit(cache=True, inline="always")
def _coords(u: int, nx: int, ny: int) -> tuple[int, int, int]:
    """``(x, y, z)`` of user voxel ``u`` (x fastest), once per voxel: the loop over its neighbours only adds."""
    t = u // nx
    return u % nx, t % ny, t // ny


@njit(cache=True, inline="always")
def _neighbour(x: int, y: int, z: int, o: int, nx: int, ny: int, nz: int, ox: np.ndarray, oy: np.ndarray,
               oz: np.ndarray) -> int:
    """User index of the neighbour of user voxel ``(x, y, z)`` along offset ``o``; -1 outside the grid."""
    xx, yy, zz = x + ox[o], y + oy[o], z + oz[o]
    if xx < 0 or xx >= nx or yy < 0 or yy >= ny or zz < 0 or zz >= nz:
        return -1
    return xx + nx * (yy + ny * zz)


@njit(parallel=True, cache=True)
def _value_kernel(f, kappa, pos, inv, nx, ny, nz, kind, gamma, eps, ox, oy, oz, w, block):  # pragma: no cover - numba
    n = f.shape[0]
    nblocks = (n + block - 1) // block
    partial = np.zeros(nblocks, dtype=np.float64)
    perm = pos.shape[0] > 0
    has_k = kappa.shape[0] > 0
    for b in prange(nblocks):
        acc = 0.0
        for jp in range(b * block, min(n, (b + 1) * block)):
            u = np.int64(pos[jp]) if perm else np.int64(jp)
            x, y, z = _coords(u, nx, ny)
            a = np.float64(f[jp])
            kj = np.float64(kappa[jp]) if has_k else 1.0
            for o in range(13):
                k = _neighbour(x, y, z, o, nx, ny, nz, ox, oy, oz)
                if k < 0:
                    continue
                kp = np.int64(inv[k]) if perm else np.int64(k)
                kk = np.float64(kappa[kp]) if has_k else 1.0
                acc += w[o] * kj * kk * _phi(a, np.float64(f[kp]), kind, gamma, eps)
        partial[b] = acc
    total = 0.0
    for b in range(nblocks):
        total += partial[b]
    return total


@njit(parallel=True, cache=True)
def _stencil_kernel(f, kappa, pos, inv, nx, ny, nz, kind, gamma, eps, ox, oy, oz, w, mode, out, out2):  # pragma: no cover
    """``out[j] = sum over the 26 neighbours k of kappa_j kappa_k w_jk dphi(f_j, f_k)`` (mode 0), the same with
    d2phi (mode 1), or both in one pass over the neighbours (mode 2: dphi into ``out``, d2phi into ``out2``;
    each sum in the same order as alone)."""
    n = f.shape[0]
    perm = pos.shape[0] > 0
    has_k = kappa.shape[0] > 0
    for jp in prange(n):
        u = np.int64(pos[jp]) if perm else np.int64(jp)
        x, y, z = _coords(u, nx, ny)
        a = np.float64(f[jp])
        kj = np.float64(kappa[jp]) if has_k else 1.0
        acc = 0.0
        acc2 = 0.0
        for o in range(26):
            k = _neighbour(x, y, z, o, nx, ny, nz, ox, oy, oz)
            if k < 0:
                continue
            kp = np.int64(inv[k]) if perm else np.int64(k)
            kk = np.float64(kappa[kp]) if has_k else 1.0
            bk = np.float64(f[kp])
            if mode == 1:
                acc += w[o] * kk * _d2phi(a, bk, kind, gamma, eps)
            else:
                acc += w[o] * kk * _dphi(a, bk, kind, gamma, eps)
                if mode == 2:
                    acc2 += w[o] * kk * _d2phi(a, bk, kind, gamma, eps)
        out[jp] = kj * acc
        if mode == 2:
            out2[jp] = kj * acc2


# --------------------------------------------------------------------------- the prior


def _is_cupy(a: Any) -> bool:
    return type(a).__module__.split(".")[0] == "cupy"


@dataclass(frozen=True, eq=False)
class Prior:
    """A prior on an image grid, in the caller's voxel order (build it with :func:`make_prior`).

    Attributes
    ----------
    kind
        ``rdp`` or ``quadratic``.
    grid
        ``(nx, ny, nz)`` of the user's image.
    beta, gamma, epsilon
        The strength (``beta >= 0``, the objective's ``beta R(f)``; the methods return ``R``, not ``beta R``),
        the RDP's edge preservation (``gamma >= 0``) and its smoothing (``epsilon > 0``; unused by the
        quadratic prior).
    kappa
        float32[n] per-voxel weights in the caller's order, or None (1 everywhere).
    pos, inv
        int64[n]: the user's voxel of each caller voxel and the caller's voxel of each user voxel; None when
        the caller holds the user's order.
    """

    kind: str
    grid: tuple[int, int, int]
    beta: float
    gamma: float
    epsilon: float
    kappa: np.ndarray | None = None
    pos: np.ndarray | None = None
    inv: np.ndarray | None = None
    _device: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def n(self) -> int:
        """Voxels of the grid."""
        return math.prod(self.grid)

    @property
    def code(self) -> int:
        """The kernels' code of :attr:`kind` (0 rdp, 1 quadratic)."""
        return KINDS[self.kind]

    @property
    def offsets(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The stencil's 26 neighbour offsets (x, y, z) and weights, as the kernels take them."""
        return _OX, _OY, _OZ, _W

    def _check(self, f: Any) -> None:
        if getattr(f, "ndim", None) != 1 or f.shape[0] != self.n:
            raise ConfigError("image", f"has shape {tuple(getattr(f, 'shape', ()))}, expected a vector of "
                              f"{self.n} voxels (grid {'x'.join(map(str, self.grid))})")  # fmt: skip
        if f.dtype not in (np.float32, np.float64):
            raise ConfigError("image", f"has dtype {f.dtype}, expected float32 or float64")

    def _host_args(self, f: np.ndarray) -> tuple:
        empty_i = np.zeros(0, dtype=np.int64)
        kappa = self.kappa if self.kappa is not None else np.zeros(0, dtype=np.float32)
        pos = self.pos if self.pos is not None else empty_i
        inv = self.inv if self.inv is not None else empty_i
        nx, ny, nz = self.grid
        return (np.ascontiguousarray(f), kappa, pos, inv, nx, ny, nz, self.code, float(self.gamma),
                float(self.epsilon), _OX, _OY, _OZ, _W)  # fmt: skip

    def value(self, f: Any) -> float:
        """``R(f)`` (without ``beta``), summed in float64.

        Parameters
        ----------
        f
            float32 or float64 image of n voxels in the caller's order (NumPy or CuPy).
        """
        self._check(f)
        if _is_cupy(f):
            from mlemlib import _prior_cuda

            return _prior_cuda.value(self, f)
        return float(_value_kernel(*self._host_args(f), VALUE_BLOCK))

    def gradient(self, f: Any, out: Any = None) -> Any:
        """``dR/df`` (without ``beta``) in the image's dtype, order and namespace.

        Parameters
        ----------
        f
            The image (float32 or float64, n voxels; NumPy or CuPy).
        out
            Optional output of the same shape and dtype (written in place and returned).
        """
        return self._stencil(f, out, second=False)

    def curvature(self, f: Any, out: Any = None) -> Any:
        """The diagonal of the Hessian of ``R`` at ``f``: ``sum_k kappa_j kappa_k w_jk d^2 phi(f_j, f_k) / df_j^2``.

        What a preconditioner of the prior term needs (e.g. ``f / (s + beta f H_jj)``); non-negative (both
        priors are convex); ``sum_k kappa_j kappa_k w_jk`` for the quadratic prior.
        """
        return self._stencil(f, out, second=True)

    def gradient_and_curvature(self, f: Any) -> tuple[Any, Any]:
        """:meth:`gradient` and :meth:`curvature` at ``f``, the same values; on the CPU in one pass over the
        neighbours (BSREM's ``hessian`` preconditioner needs both at each sub-iteration's image)."""
        if _is_cupy(f):
            return self.gradient(f), self.curvature(f)
        self._check(f)
        grad, curv = np.empty_like(f), np.empty_like(f)
        _stencil_kernel(*self._host_args(f), 2, grad, curv)
        return grad, curv

    def _stencil(self, f: Any, out: Any, second: bool) -> Any:
        self._check(f)
        if out is None:
            if _is_cupy(f):
                import cupy

                out = cupy.empty_like(f)
            else:
                out = np.empty_like(f)
        elif out.shape != f.shape or out.dtype != f.dtype:
            raise ConfigError("out", f"is {out.dtype}{list(out.shape)}, expected {f.dtype}{list(f.shape)}")
        if _is_cupy(f):
            from mlemlib import _prior_cuda

            return _prior_cuda.stencil(self, f, out, second)
        _stencil_kernel(*self._host_args(f), 1 if second else 0, out, out)
        return out


def _number(key: str, value: Any, *, positive: bool = False) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ConfigError(key, f"{value!r} is not a number") from None
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise ConfigError(key, f"{value!r}, expected a finite number {'> 0' if positive else '>= 0'}")
    return v


def make_prior(
    kind: str,
    grid: Any,
    *,
    beta: float,
    gamma: float = DEFAULT_GAMMA,
    epsilon: float | None = None,
    kappa: Any = None,
    voxels: np.ndarray | None = None,
) -> Prior:
    """A validated :class:`Prior`.

    Parameters
    ----------
    kind
        ``rdp`` (relative difference) or ``quadratic``.
    grid
        ``(nx, ny, nz)`` of the image (:func:`require_grid` reads a matrix's).
    beta
        Strength, ``>= 0``.
    gamma
        RDP edge preservation, ``>= 0`` (default 2).
    epsilon
        RDP smoothing, ``> 0``: required for ``rdp``, ignored for ``quadratic``. Choose it small against
        the image's values in the object (e.g. 1e-3 of their mean).
    kappa
        Per-voxel weights in the user's order: an array of n values ``>= 0`` or a file
        (:func:`read_kappa`); None for 1 everywhere.
    voxels
        The matrix's voxel permutation (``Permutation.voxels``: caller voxel ``j'`` is user voxel
        ``voxels[j']``): the prior then takes and returns images in that order. None: the user's order.

    Raises
    ------
    ConfigError
        One line naming the key: an unknown type, a negative ``beta`` or ``gamma``, a missing or
        non-positive ``epsilon``, a bad grid, kappa of the wrong size or with NaN or negative values,
        a voxel permutation that is not one of n voxels.
    """
    if kind not in KINDS:
        raise ConfigError("prior.type", f"{kind!r}, expected one of {', '.join(KINDS)}")
    g = check_grid(grid, key="prior.grid")
    n = math.prod(g)
    b = _number("prior.beta", beta)
    gm = _number("prior.gamma", gamma)
    if kind == "rdp":
        if epsilon is None:
            raise ConfigError("prior.epsilon", "missing: the relative difference prior needs epsilon > 0")
        eps = _number("prior.epsilon", epsilon, positive=True)
    else:
        eps = 0.0 if epsilon is None else _number("prior.epsilon", epsilon, positive=True)
    pos = inv = None
    if voxels is not None:
        from mlemlib.permutation import check_permutation

        try:
            pos = check_permutation(voxels, n, "voxels", "voxel permutation")
        except MatrixFormatError as exc:  # names 'voxels': a configuration fault here
            raise ConfigError("prior.voxels", str(exc).split(": ", 1)[-1]) from None
        inv = np.empty(n, dtype=np.int64)
        inv[pos] = np.arange(n, dtype=np.int64)
    k = None
    if kappa is not None:
        k = read_kappa(kappa, n) if not isinstance(kappa, np.ndarray) else check_kappa(kappa, n, "prior.kappa")
        if pos is not None:
            k = np.ascontiguousarray(k[pos])
    return Prior(kind, g, b, gm, eps, k, pos, inv)


# --------------------------------------------------------------------------- kappa and the grid


def check_kappa(values: Any, n: int, name: str) -> np.ndarray:
    """``values`` as float32[n] after checking its size, NaN/Inf and signs (one line naming ``name``)."""
    v = np.asarray(values).reshape(-1)
    if v.dtype.kind not in "fiu":
        raise ConfigError(name, f"kappa has dtype {v.dtype}, expected numbers")
    if v.size != n:
        raise ConfigError(name, f"{v.size} kappa values, expected one per voxel ({n}, the matrix's columns)")
    v = v.astype(np.float32)
    finite = np.isfinite(v)
    if not finite.all():
        i = int(np.argmax(~finite))
        raise ConfigError(name, f"kappa {float(v[i])} at voxel {i} (NaN or Inf)")
    if (v < 0).any():
        i = int(np.argmax(v < 0))
        raise ConfigError(name, f"negative kappa {float(v[i])} at voxel {i}")
    return v


def read_kappa(spec: str | os.PathLike, n: int) -> np.ndarray:
    """The per-voxel weights ``kappa`` (float32[n], the user's voxel order) from a file.

    Parameters
    ----------
    spec
        A raw little-endian float32 file of n values, ``file.h5:/dataset``, or an HDF5 file holding one
        dataset (any shape; read flat in C order, i.e. ``(nz, ny, nx)`` for an image).
    n
        Voxels of the image.

    Raises
    ------
    ConfigError
        One line naming the file: missing, a size that is not whole float32 values, the wrong number of
        values, NaN or Inf, a negative value.
    """
    from mlemlib.corrections import read_float32_file

    name = os.fspath(spec)
    return check_kappa(read_float32_file(name, "kappa", "voxel"), n, name)


def require_grid(matrix: Any, name: str | None = None) -> tuple[int, int, int]:
    """The voxel grid of a matrix (a path or an opened matrix), for a prior; refused in one line without one.

    Raises
    ------
    ConfigError
        Naming the matrix: it has no voxel grid (``.npz`` and ``.mtx`` matrices, and containers converted
        from them, have none until ``mlem convert --grid NX NY NZ`` records one), or one that disagrees
        with its column count.
    """
    from mlemlib.formats import geometry_value, open_matrix

    if isinstance(matrix, (str, os.PathLike)):
        with open_matrix(matrix) as src:
            return require_grid(src, name or os.fspath(matrix))
    label = name or os.fspath(getattr(matrix, "path", None) or getattr(matrix, "source", None) or "matrix")
    grid = geometry_value(matrix, "grid")
    if grid is None:
        raise ConfigError(label, "has no voxel grid, which a prior needs: record one with "
                          "'mlem convert MATRIX --grid NX NY NZ --out matrix.h5'")  # fmt: skip
    return check_grid(grid, int(matrix.shape[1]), key=label)


__all__ = [
    "DEFAULT_GAMMA",
    "KINDS",
    "Prior",
    "check_grid",
    "check_kappa",
    "given_geometry",
    "make_prior",
    "neighbour_offsets",
    "neighbour_pairs",
    "read_kappa",
    "require_grid",
]
