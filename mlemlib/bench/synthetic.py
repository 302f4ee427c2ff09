"""Synthetic PET-like system matrices for benchmarks and tests: tubes of response (CPU with Numba, or CUDA).

Provides

- :func:`tor_geometry`, :func:`tor_matrix` — a tube-of-response system matrix
  in sinogram order (plane, angle, offset), generated on the CPU (Numba) or on
  the GPU (``device=True``, seconds for 1e9 non-zeros; CuPy and
  ``kernels/synth.cu``); both give identical arrays;
- :func:`tor_host` — the same as a host :class:`CSRMatrix`, generated on the
  GPU where CuPy sees one (the benchmark runner's way to a large one);
- :func:`shuffle_rows` — the rows of a matrix in a seeded random order (a
  matrix whose LOR order carries no locality).
"""

from __future__ import annotations

import importlib.resources
import math
from typing import Any

import numpy as np
from numba import njit, prange

from mlemlib.errors import ConfigError
from mlemlib.matrix import CSRMatrix

#: The five sizes of :func:`tor_matrix`, in order.
TOR_SIZES = ("nx", "ny", "nz", "n_angles", "n_offsets")

def tor_geometry(nx: int, ny: int, nz: int, n_angles: int, n_offsets: int, width: float = 3.0) -> dict[str, Any]:
    """Parameters of :func:`tor_matrix` (shared by the CPU and GPU generators).

    Returns
    -------
    dict
        ``m``, ``n``, ``cs``, ``sn`` (float64 tables of the angles
        ``pi * a / n_angles``), ``w`` (half width), ``ds`` (offset spacing:
        the image diagonal over ``n_offsets``), ``cx``, ``cy`` (image centre).
    """
    for name, v in (("nx", nx), ("ny", ny), ("nz", nz), ("n_angles", n_angles), ("n_offsets", n_offsets)):
        if int(v) < 1:
            raise ConfigError(name, f"must be >= 1, got {v}")
    if not width > 0:
        raise ConfigError("width", f"tube width must be > 0, got {width}")
    planes = nz - 1 if nz > 1 else 1
    angles = np.pi * np.arange(n_angles, dtype=np.float64) / n_angles
    return {
        "nx": int(nx),
        "ny": int(ny),
        "nz": int(nz),
        "n_angles": int(n_angles),
        "n_offsets": int(n_offsets),
        "m": planes * n_angles * n_offsets,
        "n": nx * ny * nz,
        "cs": np.cos(angles),
        "sn": np.sin(angles),
        "w": float(width) / 2.0,
        "ds": math.hypot(nx, ny) / n_offsets,
        "cx": (nx - 1) / 2.0,
        "cy": (ny - 1) / 2.0,
    }


@njit(cache=True, nogil=True)
def _tor_row(r, nx, ny, nz, n_angles, n_offsets, w, ds, cx, cy, cs_tab, sn_tab, col, val, k0, fill):  # pragma: no cover
    per_plane = n_angles * n_offsets
    plane = r // per_plane
    angle = (r % per_plane) // n_offsets
    offset = r % n_offsets
    cs = cs_tab[angle]
    sn = sn_tab[angle]
    s = (float(offset) - float(n_offsets - 1) * 0.5) * ds
    nslices = 2 if nz > 1 else 1
    count = 0
    for dz in range(nslices):
        z = plane + dz
        for y in range(ny):
            u = (float(y) - cy) * sn - s
            if cs == 0.0:
                xlo = 0
                xhi = nx - 1
            else:
                xa = cx + (-u - w) / cs
                xb = cx + (-u + w) / cs
                if xa > xb:
                    xa, xb = xb, xa
                xa = max(xa, -1.0)
                xb = min(xb, float(nx))
                xlo = max(math.floor(xa), 0)
                xhi = min(math.ceil(xb), nx - 1)
            for x in range(xlo, xhi + 1):
                d = abs((float(x) - cx) * cs + u)
                if d < w:
                    if fill:
                        col[k0 + count] = (z * ny + y) * nx + x
                        val[k0 + count] = np.float32(1.0 - d / w)
                    count += 1
    return count


@njit(parallel=True, cache=True, nogil=True)
def _tor_count(m, nx, ny, nz, n_angles, n_offsets, w, ds, cx, cy, cs_tab, sn_tab, counts):  # pragma: no cover
    dummy_c = np.empty(0, dtype=np.int32)
    dummy_v = np.empty(0, dtype=np.float32)
    for r in prange(m):
        counts[r] = _tor_row(
            r, nx, ny, nz, n_angles, n_offsets, w, ds, cx, cy, cs_tab, sn_tab, dummy_c, dummy_v, 0, False
        )


@njit(parallel=True, cache=True, nogil=True)
def _tor_fill(m, nx, ny, nz, n_angles, n_offsets, w, ds, cx, cy, cs_tab, sn_tab, indptr, col, val):  # pragma: no cover
    for r in prange(m):
        _tor_row(r, nx, ny, nz, n_angles, n_offsets, w, ds, cx, cy, cs_tab, sn_tab, col, val, indptr[r], True)


def tor_matrix(
    nx: int, ny: int, nz: int, n_angles: int, n_offsets: int, width: float = 3.0, *, device: bool = False
) -> Any:
    """A synthetic PET-like system matrix: tubes of response in sinogram order.

    Row ``(plane * n_angles + angle) * n_offsets + offset`` is the strip of
    half width ``w = width / 2`` around the line at angle ``pi * angle /
    n_angles`` and signed distance ``(offset - (n_offsets - 1) / 2) * ds``
    from the image centre, through slices ``plane`` and ``plane + 1`` (planes
    = nz - 1; one slice when nz == 1). Voxel ``(x, y, z)`` is column
    ``(z * ny + y) * nx + x`` and takes ``1 - d / w``, ``d`` its centre's
    distance from the line, when ``d < w``. Columns are sorted in each row;
    rows of lines that miss the image are empty.

    Parameters
    ----------
    nx, ny, nz
        Voxel grid.
    n_angles, n_offsets
        Sinogram size per plane.
    width
        Tube width in voxels.
    device
        Generate on the current GPU with ``kernels/synth.cu`` (returns the
        device CSR type of :func:`mlemlib.backends.device_formats.device_type`);
        else on the CPU with Numba (returns a :class:`CSRMatrix`). Both give
        identical arrays.
    """
    g = tor_geometry(nx, ny, nz, n_angles, n_offsets, width)
    m, n = g["m"], g["n"]
    args = (g["nx"], g["ny"], g["nz"], g["n_angles"], g["n_offsets"], g["w"], g["ds"], g["cx"], g["cy"])
    if not device:
        counts = np.empty(m, dtype=np.int64)
        _tor_count(m, *args, g["cs"], g["sn"], counts)
        indptr = np.zeros(m + 1, dtype=np.int64)
        np.cumsum(counts, out=indptr[1:])
        nnz = int(indptr[-1])
        col = np.empty(nnz, dtype=np.int32)
        val = np.empty(nnz, dtype=np.float32)
        _tor_fill(m, *args, g["cs"], g["sn"], indptr, col, val)
        return CSRMatrix(indptr, col, val, (m, n))

    return _tor_device(g, m, n, args)


def _tor_device(g: dict[str, Any], m: int, n: int, args: tuple) -> Any:
    """:func:`tor_matrix` on the current GPU: ``synth.cu``'s ``tor_count``, a scan, ``tor_fill``."""

    from mlemlib.backends.device_formats import device_type

    arrays = _tor_device_arrays(g, m, args)
    return device_type("csr")(*arrays, (m, n))


def _tor_device_arrays(g: dict[str, Any], m: int, args: tuple) -> tuple[Any, Any, Any]:
    import cupy as cp

    source = importlib.resources.files("mlemlib.kernels").joinpath("synth.cu").read_text()
    mod = cp.RawModule(code=source, options=("--std=c++17", "--fmad=false"))
    threads = 128
    blocks = max(1, min((m + threads - 1) // threads, 1 << 20))
    gargs = (*(np.int32(v) for v in args[:5]), *(np.float64(v) for v in args[5:]))
    cs = cp.asarray(g["cs"])
    sn = cp.asarray(g["sn"])
    counts = cp.empty(max(m, 1), dtype=cp.int32)
    if m:
        mod.get_function("tor_count")((blocks,), (threads,), (*gargs, np.int64(m), cs, sn, counts))
    indptr = cp.zeros(m + 1, dtype=cp.int64)
    cp.cumsum(counts[:m], dtype=cp.int64, out=indptr[1:])
    del counts
    nnz = int(indptr[-1])
    col = cp.empty(nnz, dtype=cp.int32)
    val = cp.empty(nnz, dtype=cp.float32)
    if m:
        mod.get_function("tor_fill")((blocks,), (threads,), (*gargs, np.int64(m), cs, sn, indptr, col, val))
    return indptr, col, val


def tor_host(sizes: tuple[int, int, int, int, int] | list[int], width: float = 3.0, *, gpu: bool | None = None) -> CSRMatrix:
    """:func:`tor_matrix` of ``sizes`` as a host :class:`CSRMatrix`, generated on the GPU where there is one.

    ``gpu``: None generates on the GPU when CuPy sees one, else with Numba
    (identical arrays either way).
    """
    if len(sizes) != 5:
        raise ConfigError("tor", f"expected the five sizes {', '.join(TOR_SIZES)}, got {list(sizes)}")
    if gpu is None:
        from mlemlib.backends import cuda_available

        gpu = cuda_available()
    if not gpu:
        return tor_matrix(*sizes, width=width)
    g = tor_geometry(*sizes, width)
    args = (g["nx"], g["ny"], g["nz"], g["n_angles"], g["n_offsets"], g["w"], g["ds"], g["cx"], g["cy"])
    indptr, col, val = _tor_device_arrays(g, g["m"], args)
    out = CSRMatrix(indptr.get(), col.get(), val.get(), (g["m"], g["n"]))
    del indptr, col, val
    import cupy as cp

    cp.get_default_memory_pool().free_all_blocks()
    return out


def shuffle_rows(a: CSRMatrix, seed: int = 0) -> tuple[CSRMatrix, np.ndarray]:
    """``a``'s rows in a random order (``numpy.random.default_rng(seed).permutation``); returns the matrix
    and ``rows`` (new row ``r`` is ``a``'s row ``rows[r]``). Columns and values are copied once."""
    m, n = a.shape
    rows = np.random.default_rng(seed).permutation(m).astype(np.int64)
    lengths = np.diff(a.indptr)[rows]
    indptr = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(lengths, out=indptr[1:])
    nnz = int(indptr[-1])
    col = np.empty(nnz, dtype=np.int32)
    val = np.empty(nnz, dtype=np.float32)
    _gather_rows(a.indptr, a.indices, a.data, rows, indptr, col, val)
    return CSRMatrix(indptr, col, val, (m, n)), rows


@njit(parallel=True, cache=True, nogil=True)
def _gather_rows(ip, idx, dat, rows, out_ip, out_idx, out_dat):  # pragma: no cover - compiled
    for r in prange(rows.size):
        s = ip[rows[r]]
        k = out_ip[r]
        for t in range(ip[rows[r] + 1] - s):
            out_idx[k + t] = idx[s + t]
            out_dat[k + t] = dat[s + t]
