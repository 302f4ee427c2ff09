"""mlemlib: MLEM reconstruction with a stored PET system matrix, on CPUs and 1..N GPUs.

The package is importable without a GPU: CuPy is imported lazily by the CUDA
backend only. See ``README.md`` for the workflow and ``docs/`` for details.
"""

from __future__ import annotations

__version__ = "0.1.0"
