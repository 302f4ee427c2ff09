"""Synthetic PET scanner and exact ray tracer that writes the system matrix (CPU, Numba).

- :mod:`~mlemlib.scanner.geometry`: :class:`ScannerConfig` (crystal layers,
  blocks, rings, voxel grid), crystal faces, LOR and voxel numbering.
- :mod:`~mlemlib.scanner.presets`: :data:`PRESETS` ``small`` and ``madpet2``.
- :mod:`~mlemlib.scanner.system`: :func:`generate` (streams a ``.csr4`` file),
  :func:`trace_rows` (rows in memory), :func:`estimate` (timing from a sample).

The tracer runs on the CPU only (Numba, parallel over rows); see
``docs/scanner.md`` for the geometry and conventions.
"""

from __future__ import annotations

from mlemlib.scanner.geometry import (
    Layer,
    ScannerConfig,
    box_bounds,
    crystal_coords,
    crystal_faces,
    face_points,
    lor_index,
    voxel_index,
)
from mlemlib.scanner.presets import PRESETS, get_preset

#: Names served lazily from :mod:`mlemlib.scanner.system`, so that importing the
#: package (e.g. by the ``mlem`` command line) does not import Numba.
_SYSTEM = ("Tracer", "estimate", "generate", "trace_rows")


def __getattr__(name: str):
    if name in _SYSTEM:
        from mlemlib.scanner import system

        return getattr(system, name)
    raise AttributeError(f"module 'mlemlib.scanner' has no attribute {name!r}")


__all__ = [
    "PRESETS",
    "Layer",
    "ScannerConfig",
    "Tracer",
    "box_bounds",
    "crystal_coords",
    "crystal_faces",
    "estimate",
    "face_points",
    "generate",
    "get_preset",
    "lor_index",
    "trace_rows",
    "voxel_index",
]
