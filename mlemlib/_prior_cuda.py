"""The CUDA launcher of the prior stencils (``mlemlib/kernels/prior.cu``; CuPy imported lazily, on first use).

:class:`mlemlib.prior.Prior` calls :func:`value` and :func:`stencil` for CuPy
images. The kernels transcribe the Numba ones of :mod:`mlemlib.prior` (terms in
double, the same offsets in the same order, no atomics); they are compiled with
``--fmad=false`` so that no multiply-add is contracted where the CPU rounds twice.
The prior's arrays (kappa, the permutation, the offsets) are copied to a device
once and kept with the prior.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: Threads per block and voxels per block of the value (the ``PRIOR_*`` constants of prior.cu).
THREADS = 256
VALUE_BLOCK = 4096


def module(device_id: int) -> Any:
    """``prior.cu`` compiled for a GPU, without multiply-adds (:func:`mlemlib.backends._build.module`: once per
    process and device)."""
    from mlemlib.backends._build import Build
    from mlemlib.backends._build import module as compiled

    return compiled(Build("prior", ("--fmad=false",)), device_id)


def device_args(prior: Any, f: Any) -> tuple:
    """The kernels' leading arguments for image ``f`` (the prior's arrays uploaded to ``f``'s device once)."""
    import cupy as cp

    dev = f.device.id
    cached = prior._device.get(dev)
    if cached is None:
        ox, oy, oz, w = prior.offsets
        with cp.cuda.Device(dev):
            empty_i = cp.zeros(1, dtype=cp.int64)
            cached = (
                cp.asarray(prior.kappa) if prior.kappa is not None else cp.zeros(1, dtype=cp.float32),
                cp.asarray(prior.pos) if prior.pos is not None else empty_i,
                cp.asarray(prior.inv) if prior.inv is not None else empty_i,
                cp.asarray(ox), cp.asarray(oy), cp.asarray(oz), cp.asarray(w),
            )  # fmt: skip
        prior._device[dev] = cached
    kappa, pos, inv, ox, oy, oz, w = cached
    nx, ny, nz = prior.grid
    return (cp.ascontiguousarray(f), kappa, pos, inv, np.int32(prior.kappa is not None), np.int32(prior.pos is not None),
            np.int64(f.shape[0]), np.int64(nx), np.int64(ny), np.int64(nz), np.int32(prior.code),
            np.float64(prior.gamma), np.float64(prior.epsilon), ox, oy, oz, w)  # fmt: skip


def _suffix(f: Any) -> str:
    return "f32" if f.dtype == np.float32 else "f64"


def stencil(prior: Any, f: Any, out: Any, second: bool) -> Any:
    """The gradient (``second`` False) or the curvature of ``prior`` at CuPy image ``f``, into ``out``."""
    import cupy as cp

    n = f.shape[0]
    if not out.flags.c_contiguous:
        raise ValueError("out must be a C-contiguous CuPy vector")
    dev = cp.cuda.Device()
    blocks = max(1, min(-(-n // THREADS), 8 * dev.attributes["MultiProcessorCount"]))
    kernel = module(dev.id).get_function(f"prior_stencil_{_suffix(f)}")
    kernel((blocks,), (THREADS,), (*device_args(prior, f), np.int32(bool(second)), out))
    return out


def value(prior: Any, f: Any) -> float:
    """``R(f)`` of ``prior`` at CuPy image ``f`` (block partial sums in double, then summed in order on the host)."""
    import cupy as cp

    n = f.shape[0]
    blocks = max(1, -(-n // VALUE_BLOCK))
    partial = cp.zeros(blocks, dtype=cp.float64)
    kernel = module(cp.cuda.Device().id).get_function(f"prior_value_{_suffix(f)}")
    kernel((blocks,), (THREADS,), (*device_args(prior, f), partial))
    total = 0.0
    for p in cp.asnumpy(partial):
        total += float(p)
    return total
