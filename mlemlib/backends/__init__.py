"""Compute backends: ``cpu`` (NumPy/SciPy/Numba) and ``cuda`` (CuPy RawKernels).

:func:`get_backend_name` resolves ``auto`` to ``cuda`` where CuPy sees a GPU,
else ``cpu``. No GPU is probed at import.
"""

from __future__ import annotations

import os


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one GPU."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # ImportError, CUDARuntimeError without a driver
        return False


def get_backend_name(name: str = "auto") -> str:
    """Resolve ``auto`` (or ``$MLEM_BACKEND``) to ``cpu`` or ``cuda``."""
    name = os.environ.get("MLEM_BACKEND", name) if name == "auto" else name
    if name == "auto":
        return "cuda" if cuda_available() else "cpu"
    if name not in ("cpu", "cuda"):
        from mlemlib.errors import ConfigError

        raise ConfigError("backend", f"unknown backend {name!r}, expected auto, cpu or cuda")
    return name


def make_backend(*args, **kwargs):
    """Build the backend of one MLEM problem; see :func:`mlemlib.mlem.make_backend` (imported lazily)."""
    from mlemlib.mlem import make_backend as _make_backend

    return _make_backend(*args, **kwargs)


def uses_transpose(backend: str, bp: str) -> bool:
    """Whether a run with back-projection kernel ``bp`` reads a stored ``A^T``.

    ``notrans`` and the cuda kernels that scatter from the rows of ``A``
    (``scatter``, ``scatter_vec``, ``scatter_smem``, ``cusparse_notrans``)
    do not; every other kernel, ``auto`` included, uses the transpose when one
    is given. The workflow uses this to decide whether a run needs ``transpose.h5``.
    """
    if bp == "notrans":
        return False
    if backend == "cuda":
        from mlemlib.backends._cuda_plan import BP_KERNELS  # pure Python: no CuPy import

        kernel = BP_KERNELS.get(bp)
        return kernel is None or kernel[1]
    return True
