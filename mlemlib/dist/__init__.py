"""Scheduling GPUs and processes (host side; nothing here touches a GPU at import).

- :mod:`mlemlib.dist.lease` — per-device lock files so concurrent jobs (Snakemake,
  SLURM steps) never share a GPU; works without a GPU.
- :mod:`mlemlib.dist.mpi` — one process per GPU (several nodes): the NCCL id is
  shared through MPI (mpi4py) or a file every rank can read, and a local
  launcher.

The multi-GPU backend itself is :mod:`mlemlib.backends.nccl`, built by
:func:`mlemlib.backends.make_backend`.
"""

from __future__ import annotations

from mlemlib.dist.lease import GpuLease, LeaseTimeout, acquire, lease_gpus

__all__ = ["GpuLease", "LeaseTimeout", "acquire", "lease_gpus"]
