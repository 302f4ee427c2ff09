"""One process per GPU, on one node or many: NCCL bootstrapped by a launcher (CUDA; CuPy imported lazily).

Every process (rank) owns one GPU and one part of the partition plan and runs
:class:`mlemlib.backends.nccl.NcclBackend` with a communicator that spans all
ranks: ``NcclCommunicator(nranks, uid, rank)``. The NCCL unique id is made
by rank 0 and shared through

``mpi``
    MPI (mpi4py): ``COMM_WORLD.bcast``; ranks, sizes and local ranks from MPI.
    Use under ``mpirun``/``srun --mpi=pmix`` with an MPI library installed.
``file``
    a file on a file system every rank sees (node-local ``/tmp`` for one
    node, a shared directory across nodes): rank 0 writes
    ``{"token": ..., "uid": [...]}`` atomically, the others wait for it.
    Ranks come from the launcher's environment (SLURM ``srun``, Open MPI,
    MPICH/PMI, or ``MLEM_RANK``/``MLEM_WORLD_SIZE``/``MLEM_LOCAL_RANK``), so no
    MPI library is needed. The token (``$MLEM_RUN_ID``, else SLURM's job and
    step ids) keeps a stale file of an earlier run from being taken.

:func:`launch_local` starts P such processes on this node (the ``file``
bootstrap), for machines without ``mpirun``.

Each rank selects GPU ``local_rank % device_count`` (one GPU per rank when
the launcher sets ``CUDA_VISIBLE_DEVICES`` per rank).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlemlib.errors import ConfigError, DeviceError

log = logging.getLogger(__name__)

#: Launcher variables, in order of preference: (rank, size, local rank).
RANK_VARIABLES = (
    ("MLEM_RANK", "MLEM_WORLD_SIZE", "MLEM_LOCAL_RANK"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)
BOOTSTRAPS = ("mpi", "file")


@dataclass(frozen=True)
class RankInfo:
    """Where this process stands: ``rank`` of ``size``, ``local_rank`` on its node."""

    rank: int
    size: int
    local_rank: int
    source: str


def _int(env: Mapping[str, str], name: str) -> int | None:
    v = env.get(name)
    if v is None or v.strip() == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise ConfigError(name, f"expected an integer, found {v!r}") from None


def detect_rank(env: Mapping[str, str] | None = None) -> RankInfo | None:
    """Rank, size and local rank from the launcher's environment, or None outside a launcher.

    Raises
    ------
    ConfigError
        A variable that is not an integer, or a rank outside ``[0, size)``.
    """
    env = os.environ if env is None else env
    for rank_v, size_v, local_v in RANK_VARIABLES:
        rank, size = _int(env, rank_v), _int(env, size_v)
        if rank is None or size is None:
            continue
        local = _int(env, local_v)
        if size < 1 or not 0 <= rank < size:
            raise ConfigError(rank_v, f"rank {rank} is not in [0, {size}) ({size_v}={size})")
        return RankInfo(rank, size, rank if local is None else local, rank_v)
    return None


def default_token(env: Mapping[str, str] | None = None) -> str:
    """The run's token: ``$MLEM_RUN_ID``, else ``SLURM_JOB_ID.SLURM_STEP_ID``, else empty (no check)."""
    env = os.environ if env is None else env
    if env.get("MLEM_RUN_ID"):
        return env["MLEM_RUN_ID"]
    if env.get("SLURM_JOB_ID"):
        return f"{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '')}"
    return ""


def exchange_id_file(
    path: str | os.PathLike,
    rank: int,
    make_id: Any,
    *,
    token: str = "",
    timeout: float = 300.0,
    poll: float = 0.05,
) -> list[int]:
    """Share rank 0's NCCL unique id through a file; every rank returns the same id.

    Parameters
    ----------
    path
        The id file (every rank must see the same file).
    rank
        This process's rank; rank 0 calls ``make_id()`` and writes the file.
    make_id
        Callable returning the id (a sequence of ints; NCCL's 128 bytes).
    token
        Written by rank 0 and required by the others, so a stale file of
        another run is ignored until rank 0 replaces it.
    timeout
        Seconds the other ranks wait for the file.

    Raises
    ------
    DeviceError
        Timed out waiting for rank 0.
    """
    p = Path(path)
    if rank == 0:
        uid = [int(v) for v in make_id()]
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
        with os.fdopen(fd, "w") as fh:
            json.dump({"token": token, "uid": uid, "pid": os.getpid()}, fh)
        os.replace(tmp, p)
        return uid
    deadline = time.monotonic() + timeout
    while True:
        try:
            rec = json.loads(p.read_text())
            if rec.get("token") == token and isinstance(rec.get("uid"), list):
                return [int(v) for v in rec["uid"]]
        except (OSError, ValueError):
            pass  # not there yet, or being replaced
        if time.monotonic() >= deadline:
            raise DeviceError(f"{p}: rank {rank} waited {timeout:g} s for rank 0's NCCL id (token {token!r})")
        time.sleep(poll)


def _mpi_world():
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError) as exc:
        raise DeviceError(f"bootstrap 'mpi' needs mpi4py with an MPI library: {exc}") from exc
    return MPI.COMM_WORLD


def init_communicator(
    bootstrap: str = "auto",
    *,
    id_file: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 300.0,
) -> tuple[Any, RankInfo, int]:
    """Create this rank's NCCL communicator.

    Parameters
    ----------
    bootstrap
        ``mpi``, ``file`` or ``auto`` (``file`` when ``id_file`` or
        ``$MLEM_NCCL_ID_FILE`` is given, else ``mpi``).
    id_file
        The id file of the ``file`` bootstrap (default ``$MLEM_NCCL_ID_FILE``).

    Returns
    -------
    (communicator, RankInfo, device)
        The device is ``local_rank % device_count``; it is made current.
    """
    env = os.environ if env is None else env
    id_file = id_file or env.get("MLEM_NCCL_ID_FILE")
    if bootstrap == "auto":
        bootstrap = "file" if id_file else "mpi"
    if bootstrap not in BOOTSTRAPS:
        raise ConfigError("launcher", f"unknown bootstrap {bootstrap!r}, expected one of {BOOTSTRAPS}")
    try:
        import cupy as cp
        from cupy.cuda import nccl
    except ImportError as exc:
        raise DeviceError(f"the {bootstrap} bootstrap needs CuPy with NCCL: {exc}") from exc

    if bootstrap == "mpi":
        world = _mpi_world()
        rank, size = world.Get_rank(), world.Get_size()
        from mpi4py import MPI

        local = world.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
        info = RankInfo(rank, size, local, "mpi4py")
    else:
        info = detect_rank(env)
        if info is None:
            raise ConfigError("launcher", "bootstrap 'file' needs a rank from the launcher (srun, mpirun, MLEM_RANK)")
        if not id_file:
            raise ConfigError("MLEM_NCCL_ID_FILE", "bootstrap 'file' needs an id file every rank can read")
    ndev = cp.cuda.runtime.getDeviceCount()
    if ndev < 1:
        raise DeviceError("no GPU visible to this rank")
    device = info.local_rank % ndev
    cp.cuda.Device(device).use()
    if bootstrap == "mpi":
        uid = world.bcast(nccl.get_unique_id() if info.rank == 0 else None, root=0)  # bytes, any CuPy form
    else:
        uid = exchange_id_file(id_file, info.rank, nccl.get_unique_id, token=default_token(env), timeout=timeout)
    with cp.cuda.Device(device):
        comm = _communicator(nccl, info.size, uid, info.rank)
    log.info("rank %d of %d (local %d, %s) on GPU %d: NCCL communicator ready", info.rank, info.size, info.local_rank, info.source, device)
    return comm, info, device


def unique_id_value(uid: Any) -> bytes | tuple[int, ...]:
    """NCCL's unique id in the form ``NcclCommunicator`` takes: bytes (CuPy >= 13) from a list of ints.

    Values may come as 0..255 (bytes) or as signed chars (older CuPy's tuples).
    """
    if isinstance(uid, (bytes, bytearray)):
        return bytes(uid)
    return bytes(int(v) & 0xFF for v in uid)


def _communicator(nccl: Any, size: int, uid: Any, rank: int) -> Any:
    value = unique_id_value(uid)
    try:
        return nccl.NcclCommunicator(size, value, rank)
    except TypeError:  # an older CuPy takes a tuple of signed chars
        return nccl.NcclCommunicator(size, tuple(b - 256 if b > 127 else b for b in value), rank)


def launch_local(
    nprocs: int,
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    id_dir: str | os.PathLike | None = None,
    timeout: float | None = None,
    one_gpu_each: bool = True,
) -> list[int]:
    """Start ``nprocs`` ranks of ``argv`` on this node with the ``file`` bootstrap; wait; return their exit codes.

    Each rank gets ``MLEM_RANK``, ``MLEM_WORLD_SIZE``, ``MLEM_LOCAL_RANK``,
    ``MLEM_LAUNCHER=file``, ``MLEM_NCCL_ID_FILE`` and a fresh ``MLEM_RUN_ID``;
    with ``one_gpu_each`` also ``CUDA_VISIBLE_DEVICES`` naming its own GPU
    (taken from the parent's ``CUDA_VISIBLE_DEVICES``, if set, else the index).
    If one rank fails, the others are stopped.
    """
    if nprocs < 1:
        raise ConfigError("nprocs", f"must be >= 1, got {nprocs}")
    base = dict(os.environ if env is None else env)
    run_id = secrets.token_hex(8)
    id_dir = Path(id_dir or tempfile.gettempdir())
    id_file = id_dir / f"mlem-nccl-{run_id}.json"
    from mlemlib.dist.lease import parse_visible_devices

    visible = parse_visible_devices(base["CUDA_VISIBLE_DEVICES"]) if "CUDA_VISIBLE_DEVICES" in base else None
    if one_gpu_each and visible is not None and len(visible) < nprocs:
        raise ConfigError("nprocs", f"{nprocs} ranks but only {len(visible)} GPUs visible ({base['CUDA_VISIBLE_DEVICES']!r})")
    procs = []
    for r in range(nprocs):
        e = dict(base)
        e.update(
            MLEM_RANK=str(r),
            MLEM_WORLD_SIZE=str(nprocs),
            MLEM_LOCAL_RANK=str(r),
            MLEM_LAUNCHER="file",
            MLEM_NCCL_ID_FILE=str(id_file),
            MLEM_RUN_ID=run_id,
        )
        if one_gpu_each:
            e["CUDA_VISIBLE_DEVICES"] = visible[r] if visible is not None else str(r)
            e["MLEM_LOCAL_RANK"] = "0"
        procs.append(subprocess.Popen(list(argv), env=e))
    codes: list[int | None] = [None] * nprocs
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while any(c is None for c in codes):
            for i, p in enumerate(procs):
                if codes[i] is None:
                    codes[i] = p.poll()
            if any(c not in (None, 0) for c in codes):
                break  # one failed: the others would wait for it for ever
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        for i, p in enumerate(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            codes[i] = p.returncode
        id_file.unlink(missing_ok=True)
    return [int(c) for c in codes]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mlemlib.dist.mpi -n P -- COMMAND...``: run P local ranks of COMMAND (file bootstrap)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m mlemlib.dist.mpi", description=main.__doc__)
    p.add_argument("-n", "--nprocs", type=int, required=True, metavar="P", help="number of ranks (one GPU each)")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND")
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        p.error("give a command after --")
    codes = launch_local(args.nprocs, cmd)
    return max(codes, key=abs) if any(codes) else 0


if __name__ == "__main__":
    sys.exit(main())
