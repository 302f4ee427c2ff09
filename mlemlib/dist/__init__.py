"""Multi-GPU MLEM: NCCL across the GPUs of one process or one process per GPU, and GPU leases.

- :mod:`mlemlib.dist.lease` — per-device lock files so concurrent jobs (Snakemake,
  SLURM steps) never share a GPU; host side, works without a GPU.
- :mod:`mlemlib.dist.nccl` — the ``cuda-nccl`` backend: one process drives P GPUs
  (``NcclCommunicator.initAll``), layouts ``local`` and ``thesis``, optional
  CUDA-graph capture of the whole iteration.
- :mod:`mlemlib.dist.mpi` — one process per GPU (several nodes): the NCCL id is
  shared through MPI (mpi4py), a file on a shared file system, or the
  environment a launcher sets.

Nothing here touches a GPU at import; CuPy is imported inside functions.
"""

from __future__ import annotations

from mlemlib.dist.lease import GpuLease, LeaseTimeout, acquire, lease_gpus

__all__ = ["GpuLease", "LeaseTimeout", "acquire", "lease_gpus"]
