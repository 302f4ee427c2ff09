"""Multi-GPU MLEM: NCCL across the GPUs of one process or one process per GPU, and GPU leases.

- :mod:`mlemlib.dist.lease` — per-device lock files so concurrent jobs (Snakemake,
  SLURM steps) never share a GPU; host side, works without a GPU.
- :mod:`mlemlib.dist.nccl` — the ``cuda-nccl`` backend: one process drives P GPUs
  (``NcclCommunicator.initAll``), layouts ``local`` and ``thesis``, optional
  CUDA-graph capture of the whole iteration.
- :mod:`mlemlib.dist.mpi` — one process per GPU (several nodes): the NCCL id is
  shared through MPI (mpi4py) or a file every rank can read.

Nothing here touches a GPU at import; CuPy is imported inside functions.
"""

from __future__ import annotations

import os
from typing import Any

from mlemlib.dist.lease import GpuLease, LeaseTimeout, acquire, lease_gpus
from mlemlib.errors import ConfigError

__all__ = ["GpuLease", "LeaseTimeout", "acquire", "lease_gpus", "make_backend", "LAUNCHERS"]

#: ``none``: one process drives all GPUs; ``mpi`` / ``file``: one process per GPU (mlemlib.dist.mpi).
LAUNCHERS = ("none", "mpi", "file")


def make_backend(matrix: Any, g: Any, norm: Any, *, launcher: str | None = None, **kw: Any):
    """The multi-GPU backend the MLEM loop asks for (``gpus > 1``).

    Parameters
    ----------
    launcher
        ``none`` (default): this process drives ``gpus`` GPUs
        (:class:`mlemlib.dist.nccl.NcclBackend`); ``mpi`` or ``file``: this
        process is one rank of a launcher (``srun``, ``mpirun``,
        :func:`mlemlib.dist.mpi.launch_local`) and drives one GPU. Default
        ``$MLEM_LAUNCHER`` or ``none``.
    kw
        ``gpus``, ``layout``, ``plan``, ``transpose``, ``fp``, ``bp``,
        ``secsize``, ``graph``... (see :class:`~mlemlib.dist.nccl.NcclBackend`).
    """
    launcher = launcher or os.environ.get("MLEM_LAUNCHER") or "none"
    if launcher not in LAUNCHERS:
        raise ConfigError("MLEM_LAUNCHER", f"unknown launcher {launcher!r}, expected one of {', '.join(LAUNCHERS)}")
    if launcher == "none":
        from mlemlib.dist.nccl import make_backend as single

        return single(matrix, g, norm, **kw)
    from mlemlib.dist.mpi import make_backend as ranked

    return ranked(matrix, g, norm, bootstrap=launcher, **kw)
