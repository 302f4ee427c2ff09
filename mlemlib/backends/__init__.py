"""Compute backends and the one place that builds them.

- :mod:`~mlemlib.backends.cpu` (NumPy/SciPy/Numba), :mod:`~mlemlib.backends.cuda`
  (one GPU, CuPy RawKernels), :mod:`~mlemlib.backends.nccl` (several GPUs,
  NCCL all-reduces; also one GPU with CUDA graphs), all deriving from
  :class:`~mlemlib.backends.base.Backend`;
- :func:`make_backend` builds one from the model's arrays (a run's, through
  :func:`mlemlib.mlem.build_backend`; the benchmarks and tests directly);
  :func:`get_backend_name` resolves ``auto`` to ``cuda`` where CuPy sees a GPU,
  else ``cpu``.

Which kernel a name means is decided in :mod:`mlemlib.registry`. No GPU is
probed and CuPy is not imported at import.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from mlemlib.backends.base import Backend, no_stored_transpose
from mlemlib.errors import ConfigError, DeviceError

#: ``none``: one process drives all GPUs; ``mpi`` / ``file``: one process per GPU (:mod:`mlemlib.dist.mpi`).
LAUNCHERS = ("none", "mpi", "file")


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one GPU."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # ImportError, CUDARuntimeError without a driver
        return False


def graph_option(setting: Any) -> bool | None:
    """A configured graph setting (``auto``, true, false; None) as :func:`make_backend`'s ``graph``: None for
    ``auto`` (the backend decides), else the bool."""
    return None if setting is None or setting == "auto" else bool(setting)


def get_backend_name(name: str = "auto") -> str:
    """Resolve ``auto`` (or ``$MLEM_BACKEND``) to ``cpu`` or ``cuda``."""
    name = os.environ.get("MLEM_BACKEND", name) if name == "auto" else name
    if name == "auto":
        return "cuda" if cuda_available() else "cpu"
    if name not in ("cpu", "cuda"):
        raise ConfigError("backend", f"unknown backend {name!r}, expected auto, cpu or cuda")
    return name


def make_backend(
    name: str,
    matrix: Any,
    g: np.ndarray,
    norm: np.ndarray,
    transpose: Any | None = None,
    *,
    fp: str = "auto",
    bp: str = "auto",
    dtype: Any = np.float32,
    gpus: int = 1,
    layout: str = "local",
    plan: Any | None = None,
    secsize: int | None = None,
    threads: int | None = None,
    launcher: str | None = None,
    chunks: Any | None = None,
    background: np.ndarray | None = None,
    subsets: np.ndarray | None = None,
    **options: Any,
) -> Backend:
    """Build the backend that runs one problem.

    Parameters
    ----------
    name
        ``auto`` (``cuda`` where CuPy sees a GPU, else ``cpu``; ``$MLEM_BACKEND`` overrides), ``cpu`` or ``cuda``.
    matrix
        ``A``: an opened matrix (``read_rows``, ``iter_chunks``, ``shape``) or a CSRMatrix.
    g
        Measurement (length m).
    norm
        Column sums of ``A`` (float64, length n); with subsets the (S, n) update norms of
        :func:`mlemlib.subsets.update_norms` (NaN: the voxel is kept in that sub-iteration).
    transpose
        ``A^T`` (opened matrix or CSRMatrix, shape (n, m)), or None: back-project with ``A``.
    fp, bp
        Kernel names of the backend (``auto`` lets it choose).
    dtype
        float32, or float64 (cpu only: the reference).
    gpus, layout, plan
        GPU count; multi-GPU layout (``local``: one all-reduce of the image,
        ``thesis``: all-reduce after both projections); the partition plan
        (a ``plan.json`` path or directory) for ``gpus > 1``.
    secsize
        Section size of the merge-based kernel (cuda).
    threads
        Host threads (cpu).
    launcher
        Several GPUs (or graph capture): ``none`` (default; this process
        drives every GPU), ``mpi`` or ``file`` (this process is one rank of a
        launcher and drives one GPU, :mod:`mlemlib.dist.mpi`). Default
        ``$MLEM_LAUNCHER`` or ``none``.
    chunks
        The matrix's row chunks as a layout file (``mlem chunk``; a path or
        an opened :class:`mlemlib.chunked.ChunkLayout`): a cuda kernel that
        reads chunks (``onepass_chunked``, also as ``auto``'s choice) loads
        them instead of chunking the matrix in every run. The cpu backend
        does not read it.
    background
        None (``b = 0``, ``m = 1``: MLEM as the thesis's), or ``b' = b / m`` per row in the
        backend's row order (float32, ``+inf`` where ``m = 0``, :func:`mlemlib.corrections.background`):
        the correlation is ``g / (A f + b')``.
    subsets
        None (S = 1), or int64 bounds of the S OSEM subsets (S + 1 values; subset k is rows
        ``[bounds[k], bounds[k+1])``): :meth:`Backend.iterate` runs S sub-iterations.
    options
        Further backend-specific keyword arguments.

    Returns
    -------
    Backend
        ``mlemlib.backends.cpu.CpuBackend``; for ``cuda`` with one GPU
        ``mlemlib.backends.cuda.CudaBackend(matrix, g, norm, transpose=, fp=, bp=[, secsize=])``
        (or that module's ``make_backend``), with several GPUs
        ``mlemlib.dist.make_backend(matrix, g, norm, transpose=, fp=, bp=, gpus=, layout=, plan=[, secsize=])``
        (or ``mlemlib.backends.nccl.make_backend``); all imported lazily.

    Raises
    ------
    ConfigError
        Unknown backend, or settings the backend cannot honour.
    DeviceError
        CUDA requested but CuPy or the CUDA backend is not available.
    """
    resolved = get_backend_name(name)
    gpus = 1 if gpus is None else int(gpus)
    if gpus < 1:
        raise ConfigError("gpus", f"must be >= 1, got {gpus}")
    if layout not in (None, "local", "thesis"):
        raise ConfigError("layout", f"unknown layout {layout!r}, expected local or thesis")
    if resolved == "cpu":
        if gpus != 1:
            raise ConfigError("gpus", f"the cpu backend runs on the host: --gpus {gpus} needs --backend cuda")
        from mlemlib.backends.cpu import CpuBackend

        return CpuBackend(matrix, g, norm, transpose=transpose, fp=fp, bp=bp, dtype=dtype, threads=threads,
                          background=background, subsets=subsets, **options)
    if np.dtype(dtype) != np.float32:
        raise ConfigError("dtype", "the cuda backend computes in float32; the float64 reference runs on the cpu")
    kw: dict[str, Any] = {"transpose": transpose, "fp": fp, "bp": bp, **options}
    if secsize is not None:
        kw["secsize"] = secsize
    if chunks is not None:
        kw["chunks"] = chunks
    if background is not None or subsets is not None:  # the GPU backends take them by the same names
        kw.update(background=background, subsets=subsets)
    launcher = launcher or os.environ.get("MLEM_LAUNCHER") or "none"
    if launcher not in LAUNCHERS:
        raise ConfigError("MLEM_LAUNCHER", f"unknown launcher {launcher!r}, expected one of {', '.join(LAUNCHERS)}")
    try:
        if subsets is not None and len(subsets) > 2:  # OSEM: one backend per subset on the same GPUs
            if launcher != "none":
                raise ConfigError("subsets", f"OSEM runs in one process (its GPUs {gpus}), not under the launcher "
                                             f"{launcher!r}")
            from mlemlib.backends.osem import OsemBackend

            kw.update(gpus=gpus, layout=layout or "local", plan=plan)
            return OsemBackend(matrix, g, norm, **kw)
        if gpus == 1 and not options.get("graph"):  # graph None (auto) or False: one GPU launches its kernels
            from mlemlib.backends.cuda import CudaBackend

            _check_transpose(matrix, bp, transpose)
            kw.pop("graph", None)
            return CudaBackend(matrix, g, norm, **kw)
        _check_part_files(matrix, bp, layout or "local", plan)
        kw.update(gpus=gpus, layout=layout or "local", plan=plan)
        from mlemlib.backends.nccl import NcclBackend
    except ImportError as exc:
        raise DeviceError(f"backend cuda with {gpus} GPU(s) is not available: {exc}") from exc
    if launcher == "none":
        return NcclBackend(matrix, g, norm, **kw)
    # one rank of a launcher: one GPU, part `rank` of a `size`-part plan
    from mlemlib.dist.mpi import init_communicator

    comm, info, device = init_communicator(launcher)
    if gpus != info.size:
        raise ConfigError("gpus", f"--gpus {gpus} but the launcher started {info.size} ranks (one GPU per rank)")
    kw.pop("devices", None)
    return NcclBackend(
        matrix, g, norm, devices=[device], parts=[info.rank], world=info.size, comms=[comm], own_comms=True, **kw
    )


def _untransposable(matrix: Any, bp: str | None) -> Any:
    """The matrix's format where ``bp`` names a back projection on ``A^T`` that reads it and a GPU cannot make
    that ``A^T`` itself (a compressed format; a GPU transposes CSR, or its block of rows, with cuSPARSE); else
    None (``auto`` chooses without one; a kernel that does not read the format is refused by its own check)."""
    from mlemlib import registry
    from mlemlib.formats.spec import matrix_format_of

    if bp in (None, "auto") or not registry.uses_transpose("cuda", bp):
        return None
    fmt = matrix_format_of(matrix)
    return None if fmt.cusparse or fmt.name not in registry.get_bp("cuda", bp).formats else fmt


def _check_part_files(matrix: Any, bp: str | None, layout: str, plan: Any) -> None:
    """Refuse, before any work, a several-GPU run whose GPUs would read their ``A_k^T`` from the partition's part
    files that its plan does not have (the local layout, :func:`_untransposable`)."""
    from mlemlib.backends._nccl_plan import plan_has_parts

    fmt = _untransposable(matrix, bp) if layout == "local" else None
    if fmt is not None and not plan_has_parts(plan):
        raise ConfigError("plan", f"bp={bp} on a {fmt.name} matrix in the local layout reads each GPU's A_k^T from "
                                  "the partition's part files (mlem partition --local-transpose), which the plan does "
                                  "not have; give that plan, or use bp auto or a one-pass kernel")


def _check_transpose(matrix: Any, bp: str | None, transpose: Any) -> None:
    """Refuse, before any work, a one-GPU run without a stored transpose that its GPU cannot make
    (:func:`_untransposable`)."""
    fmt = _untransposable(matrix, bp) if transpose is None else None
    if fmt is not None:
        raise no_stored_transpose(str(bp), fmt.name)
