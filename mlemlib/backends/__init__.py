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
