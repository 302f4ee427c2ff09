"""Cluster resource estimates for the workflow's jobs, sized from the system matrix.

Provides the numbers a batch scheduler needs before a job starts -- host memory
(``mem_mb``), wall-clock limit (``runtime``, minutes), GPUs (``gpu``) and CPUs per
GPU (``cpus_per_gpu``) -- for each workflow stage, computed from the matrix's
shape and number of stored elements, so that a bigger matrix asks for more.
The workflow's resource functions (``rules/common_resources.smk``) call these; the SLURM
profile (``profiles/slurm``) turns them into ``sbatch`` options. See
docs/cluster.md for the model and how to override it.

Backend-independent: host side, imports no CuPy. A matrix's size comes from
:mod:`mlemlib.formats` (the header of a ``.csr4`` or ``.h5`` file; a
``.mtx`` or ``.npz`` file, which has no such header, is read whole).

The model
---------
A CSR matrix with ``m`` rows, ``n`` columns and ``nnz`` elements occupies
``8 * nnz + 8 * (m + 1)`` bytes in memory (int32 column, float32 value, int64
row pointer); its transpose ``8 * nnz + 8 * (n + 1)``. Each stage's peak host
memory is a sum of such terms (see :data:`STAGES` and :func:`peak_host_bytes`)
plus :data:`BASE_MB` for the interpreter and its libraries, times
:data:`MEM_SAFETY`. Run time is the bytes each stage moves over pessimistic
rates (:data:`IO_MB_PER_S` for files, :data:`CPU_SPMV_GB_PER_S` and
:data:`GPU_SPMV_GB_PER_S` for sparse products), times :data:`TIME_SAFETY`,
plus :data:`MIN_RUNTIME_MIN`. The estimates are deliberately generous: a job
that asks for too little is killed, one that asks for a bit too much waits a
little longer in the queue.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from mlemlib.errors import ConfigError, MatrixFormatError
from mlemlib.formats.spec import ALL_FORMATS, matrix_format_of

__all__ = [
    "BASE_MB",
    "CPUS_PER_GPU",
    "FORMAT_BYTES",
    "STAGES",
    "MatrixSize",
    "NodeLimits",
    "StageNeed",
    "detect_node",
    "estimate_gpu_mem_mb",
    "estimate_mem_mb",
    "estimate_runtime_min",
    "generated_size",
    "gpus_for",
    "matrix_bytes",
    "matrix_size",
    "needs_table",
    "preset_size",
    "shortfalls",
    "stage_need",
    "stage_resources",
]

#: Workflow stages with a resource model. ``generate`` writes the matrix,
#: ``bench`` benchmarks SpMV kernels, the others are the DAG's rules.
STAGES = (
    "generate",
    "convert",
    "norm",
    "transpose",
    "partition",
    "simulate",
    "mlem",
    "bench",
    "summary",
)

#: Host memory of a Python process with NumPy, SciPy, Numba and h5py loaded (MB).
BASE_MB = 1024
#: Slots of a compressed container read per piece on the way to a GPU
#: (``mlemlib.backends._compressed_cuda.UPLOAD_CHUNK_NNZ``, kept equal by a test).
UPLOAD_PIECE_SLOTS = 1 << 26

#: Extra host memory when CuPy and the CUDA runtime are loaded (MB).
GPU_BASE_MB = 1024
#: Factor on the modelled peak memory (allocator slack, temporaries).
MEM_SAFETY = 1.5
#: Memory requests are rounded up to a multiple of this (MB).
MEM_ROUND_MB = 256
#: Elements per streamed chunk (the formats' default, ``1 << 26``).
CHUNK_NNZ = 1 << 26
#: File read/write rate assumed for a shared cluster file system (MB/s).
IO_MB_PER_S = 200.0
#: Effective sparse matrix-vector rate of the CPU backend (GB of matrix per s).
CPU_SPMV_GB_PER_S = 1.0
#: Effective sparse matrix-vector rate of one GPU (GB of matrix per s); far
#: below an H100's 3 TB/s on purpose: the estimate must hold on old GPUs too.
GPU_SPMV_GB_PER_S = 100.0
#: Factor on the modelled run time.
TIME_SAFETY = 3.0
#: Added to every run-time estimate (start-up, imports, JIT, queue-side slack).
MIN_RUNTIME_MIN = 10
#: Host CPU cores per GPU: one thread drives the device, one reads files.
CPUS_PER_GPU = 2
#: GPU memory kept free for the CUDA context, cuSPARSE buffers and vectors (MB).
GPU_RESERVE_MB = 1024

_BACKENDS = ("cpu", "cuda", "auto")
_MB = 1 << 20


@dataclass(frozen=True)
class MatrixSize:
    """Shape and number of stored elements of a system matrix.

    Attributes
    ----------
    rows, cols
        ``m`` (lines of response) and ``n`` (voxels).
    nnz
        Stored elements.
    """

    rows: int
    cols: int
    nnz: int

    def __post_init__(self) -> None:
        for name in ("rows", "cols", "nnz"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"matrix size {name}", f"must be a non-negative integer, got {value!r}")

    @property
    def csr_bytes(self) -> int:
        """Bytes of the matrix as CSR in memory (int32 columns, float32 values, int64 row pointer)."""
        return 8 * self.nnz + 8 * (self.rows + 1)

    @property
    def csr_t_bytes(self) -> int:
        """Bytes of the transpose as CSR in memory."""
        return 8 * self.nnz + 8 * (self.cols + 1)


# --- reading the size from a file header -------------------------------------------


def matrix_size(path: str | os.PathLike, *, allow_negative: bool = False) -> MatrixSize:
    """A matrix's shape and nnz, as :func:`mlemlib.formats.open_matrix` reads them.

    ``.csr4`` and ``.h5`` files (the project's container, also
    ``transpose.h5`` and ``part-k.h5``) open lazily: only their header is
    read. ``.mtx``/``.mtx.gz`` and SciPy ``.npz`` files have no header that
    gives the stored elements, so :mod:`mlemlib.formats` reads them whole;
    the result is kept per file (path, size, modification time), so that the
    workflow's many resource functions read such a file once.

    Parameters
    ----------
    path
        A ``.csr4``, ``.h5``, ``.mtx``/``.mtx.gz`` or SciPy ``.npz`` file.
    allow_negative
        Let negative values of a file read whole pass (a matrix converted
        with ``clip_negative``).

    Returns
    -------
    MatrixSize

    Raises
    ------
    MatrixFormatError
        Unknown suffix, missing file, a measurement file, or any fault
        :mod:`mlemlib.formats` finds in the file.
    """
    p = Path(path)
    try:
        st = p.stat()
    except OSError:
        raise MatrixFormatError(p, "no such file") from None
    key = (os.fspath(p.resolve()), st.st_size, st.st_mtime_ns, allow_negative)
    size = _SIZES.get(key)
    if size is None:
        from mlemlib.formats import open_matrix

        with open_matrix(p, allow_negative=allow_negative) as reader:
            rows, cols = (int(v) for v in reader.shape)
            size = _SIZES[key] = MatrixSize(rows=rows, cols=cols, nnz=int(reader.nnz))
    return size


#: :func:`matrix_size`'s results by (resolved path, bytes, modification time).
_SIZES: dict[tuple[str, int, int, bool], MatrixSize] = {}


#: Relative margin on a preset's recorded (possibly sampled) non-zeros.
PRESET_NNZ_MARGIN = 0.02

#: Voxels a tube of response crosses, per voxel of ``gridX + gridY + gridZ``
#: (one ray crosses at most that many; a tube of several rays a few times more).
TUBE_VOXELS_PER_EDGE = 4


def generated_size(preset: str) -> MatrixSize:
    """Size of the matrix ``mlem generate --preset`` will write, before it exists.

    Rows and columns are exact (the preset's shape); ``nnz`` is an upper
    estimate: every row holds at most ``TUBE_VOXELS_PER_EDGE * (gridX + gridY
    + gridZ)`` voxels (and at most all columns), and at least the preset's
    recorded non-zeros (:data:`mlemlib.scanner.presets.NNZ`, exact or a
    sampled estimate) plus :data:`PRESET_NNZ_MARGIN`. For MADPET-II that is
    1.70e9 against the real 1.60e9 (0.96e9 generated); for ``small`` 7.1e6
    against 0.74e6 (most of its rows are empty), which the request floor
    absorbs; for ``matrix3`` (wide tubes) the recorded 1.237e10 plus 2%.

    Raises
    ------
    ConfigError
        For an unknown preset.
    """
    from mlemlib.scanner import get_preset

    from mlemlib.scanner.presets import NNZ

    cfg = get_preset(preset)
    rows, cols = cfg.shape
    per_row = min(cols, TUBE_VOXELS_PER_EDGE * sum(cfg.grid))
    recorded = math.ceil(NNZ.get(preset, 0) * (1 + PRESET_NNZ_MARGIN))
    return MatrixSize(rows=rows, cols=cols, nnz=max(rows * per_row, recorded))


def preset_size(preset: str, *, fold: bool = False) -> MatrixSize:
    """The size a preset's matrix will have: its recorded non-zeros plus :data:`PRESET_NNZ_MARGIN`.

    ``fold``: the folded matrix (each LOR once, :mod:`mlemlib.fold`): half the
    rows and non-zeros (row ``(j, i)`` equals row ``(i, j)``; the diagonal is empty).

    :data:`mlemlib.scanner.presets.NNZ` is exact for ``small`` and
    ``madpet2`` and a sampled estimate for ``matrix3``; a preset without a
    record falls back to :func:`generated_size`'s upper bound. The workflow's
    statement of each stage's needs uses it before the matrix exists.
    """
    from mlemlib.scanner import get_preset
    from mlemlib.scanner.presets import NNZ

    if preset in NNZ:
        rows, cols = get_preset(preset).shape
        size = MatrixSize(rows=rows, cols=cols, nnz=math.ceil(NNZ[preset] * (1 + PRESET_NNZ_MARGIN)))
    else:
        size = generated_size(preset)
    if fold:
        size = MatrixSize(rows=size.rows // 2, cols=size.cols, nnz=-(-size.nnz // 2))
    return size


# --- the model ---------------------------------------------------------------------


def _check(stage: str, backend: str, parts: int) -> None:
    if stage not in STAGES:
        raise ConfigError("stage", f"unknown stage {stage!r}, expected one of {', '.join(STAGES)}")
    if backend not in _BACKENDS:
        raise ConfigError("backend", f"unknown backend {backend!r}, expected one of {', '.join(_BACKENDS)}")
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ConfigError("parts", f"must be a positive integer, got {parts!r}")


def gpus_for(backend: str, gpus: int) -> int:
    """GPUs a job asks the scheduler for: ``gpus`` unless the backend is ``cpu``.

    ``auto`` asks for the GPUs (it runs on them where they exist); ``cpu`` asks
    for none, so CPU-only jobs never hold a GPU.
    """
    if backend not in _BACKENDS:
        raise ConfigError("backend", f"unknown backend {backend!r}, expected one of {', '.join(_BACKENDS)}")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
        raise ConfigError("gpus", f"must be a non-negative integer, got {gpus!r}")
    return 0 if backend == "cpu" else gpus


def peak_host_bytes(
    stage: str,
    size: MatrixSize,
    *,
    parts: int = 1,
    backend: str = "cpu",
    stored_transpose: bool = True,
    threads: int = 1,
    chunk_nnz: int = CHUNK_NNZ,
    source_format: str = "csr",
) -> int:
    """Modelled peak host memory of one stage, in bytes, before base and safety.

    Parameters
    ----------
    stage
        One of :data:`STAGES`.
    size
        The matrix (for ``generate``: the one it will write).
    parts
        Row blocks / GPUs (``partition``, ``mlem``, ``bench``).
    backend
        ``cpu`` keeps the matrix in host memory for the whole run; ``cuda`` and
        ``auto`` stream it to the GPUs, one row block at a time.
    stored_transpose
        Whether back projection reads a stored ``A^T`` (``mlem``, ``bench``);
        for ``partition``, whether the parts' ``A_k^T`` are written.
    threads
        Worker threads of ``transpose`` (ScanTrans keeps one column histogram
        each) and ``generate`` (one tracer scratch each).
    chunk_nnz
        Elements per streamed chunk.
    source_format
        Format of the matrix file (``mlem``, ``bench``): a compressed
        container reaches the GPUs piece by piece (each GPU's uploader holds
        one piece of :data:`UPLOAD_PIECE_SLOTS` slots, its decoded check and
        the row pointer), a CSR file one whole row block per GPU.
    """
    _check(stage, backend, parts)
    chunk = min(size.nnz, chunk_nnz)
    vec_m, vec_n = 8 * size.rows, 8 * size.cols  # one float64 vector of each length
    a, at = size.csr_bytes, size.csr_t_bytes
    if stage == "generate":
        # Rows are traced in chunks of 2^24 (one being traced, one encoded,
        # two being written, with their encodings); the row counts; per
        # thread a float64 accumulator of n entries.
        gen_chunk = min(size.nnz, 1 << 24)
        return (4 * 8 + 3 * 5) * gen_chunk + 2 * vec_m + vec_n * max(threads, 1)
    if stage == "convert":
        # Source chunk and the next one read ahead (iter_chunks), validated copy, write buffer; both row pointers.
        return 4 * 8 * chunk + 2 * vec_m
    if stage == "norm":
        # The chunk being summed and the next one read ahead (iter_chunks) with its raw arrays.
        return 3 * 8 * chunk + vec_m + 2 * vec_n
    if stage == "transpose":
        # A and A^T in memory at once, plus one int64 column histogram per thread.
        return a + at + 8 * (size.cols + 1) * max(threads, 1)
    if stage == "partition":
        # The row pointers (A's, and A^T's); with the parts' A_k^T
        # (stored_transpose) one chunk of A^T, its split copy and split points.
        refs = 2 * vec_m + vec_n
        return refs + (3 * 8 * chunk + 8 * (parts + 1) * min(chunk, size.cols) if stored_transpose else 0)
    if stage == "simulate":
        # As the norm: the chunk being projected and the next one read ahead.
        return 3 * 8 * chunk + 3 * vec_m + 3 * vec_n
    if stage in ("mlem", "bench"):
        vectors = 4 * (vec_m + vec_n)
        if backend == "cpu":
            return a + (at if stored_transpose else 0) + vectors
        if matrix_format_of(source_format).compressed and not stored_transpose:
            # Per GPU (uploaded side by side): one piece (codes, values and its
            # decoded CSR check, at most 13 bytes a slot) and the row pointer.
            piece = 13 * min(UPLOAD_PIECE_SLOTS, size.nnz + 4 * size.rows)
            return parts * piece + 2 * vec_m + vectors
        # Each GPU's block passes through host memory on its way to the device.
        block = math.ceil((a + (at if stored_transpose else 0)) / parts)
        return block + vectors
    # summary: tables and plots of small vectors.
    return 4 * vec_n


def estimate_mem_mb(
    stage: str,
    size: MatrixSize,
    *,
    parts: int = 1,
    backend: str = "cpu",
    stored_transpose: bool = True,
    threads: int = 1,
    attempt: int = 1,
    source_format: str = "csr",
) -> int:
    """Host memory (MB) to request for one job of ``stage``.

    ``(BASE_MB [+ GPU_BASE_MB] + peak / MB) * MEM_SAFETY * attempt``, rounded up
    to :data:`MEM_ROUND_MB`. ``attempt`` is Snakemake's retry counter (1 on the
    first try), so a job killed for memory asks for more when retried.

    Parameters
    ----------
    stage, size, parts, backend, stored_transpose, threads, source_format
        See :func:`peak_host_bytes`.
    attempt
        Snakemake's ``attempt`` (>= 1).

    Returns
    -------
    int
        Megabytes, a multiple of :data:`MEM_ROUND_MB`.
    """
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 1:
        raise ConfigError("attempt", f"must be a positive integer, got {attempt!r}")
    peak = peak_host_bytes(
        stage, size, parts=parts, backend=backend, stored_transpose=stored_transpose, threads=threads,
        source_format=source_format,
    )
    base = BASE_MB + (GPU_BASE_MB if backend != "cpu" and stage in ("mlem", "bench") else 0)
    mb = (base + peak / _MB) * MEM_SAFETY * attempt
    return int(math.ceil(mb / MEM_ROUND_MB) * MEM_ROUND_MB)


def estimate_gpu_mem_mb(
    size: MatrixSize, *, parts: int = 1, stored_transpose: bool = True, fmt: str = "csr"
) -> int:
    """Device memory (MB) each of ``parts`` GPUs needs for its row block.

    The row block of ``A`` (nnz-balanced, so about ``nnz / parts`` elements)
    in the device format ``fmt`` (:data:`FORMAT_BYTES`), its share of ``A^T``
    (CSR) when stored, the full-length image, norm and back projection
    vectors (float32), plus :data:`GPU_RESERVE_MB`. Compare it with the GPU
    model's memory to choose the number of GPUs.
    """
    _check("mlem", "cuda", parts)
    if fmt not in FORMAT_BYTES:
        raise ConfigError("format", f"unknown matrix format {fmt!r}, expected one of {', '.join(FORMAT_BYTES)}")
    per_nnz, per_row = FORMAT_BYTES[fmt]
    per_part = math.ceil(size.nnz / parts)
    block = math.ceil(per_nnz * per_part + per_row * (math.ceil(size.rows / parts) + 1))
    if stored_transpose:
        block += 8 * per_part + 8 * (size.cols + 1)
    vectors = 4 * (2 * math.ceil(size.rows / parts) + 4 * size.cols)
    return math.ceil((block + vectors) / _MB) + GPU_RESERVE_MB


def estimate_runtime_min(
    stage: str,
    size: MatrixSize,
    *,
    iterations: int = 1,
    repetitions: int = 1,
    parts: int = 1,
    backend: str = "cpu",
    stored_transpose: bool = True,
    attempt: int = 1,
) -> int:
    """Wall-clock limit (whole minutes) to request for one job of ``stage``.

    ``MIN_RUNTIME_MIN + TIME_SAFETY * seconds / 60``, times ``attempt``, where
    ``seconds`` is the modelled time: bytes read and written over
    :data:`IO_MB_PER_S`, plus, for ``mlem``/``bench``, ``iterations *
    repetitions`` forward and back projections over the backend's SpMV rate
    (:data:`CPU_SPMV_GB_PER_S`, or :data:`GPU_SPMV_GB_PER_S` per GPU).

    Parameters
    ----------
    stage, size, parts, backend, stored_transpose
        See :func:`peak_host_bytes`.
    iterations, repetitions
        MLEM iterations and timed repetitions (``mlem``, ``bench``).
    attempt
        Snakemake's ``attempt`` (>= 1).
    """
    _check(stage, backend, parts)
    for name, value in (("iterations", iterations), ("repetitions", repetitions), ("attempt", attempt)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(name, f"must be a positive integer, got {value!r}")
    io = IO_MB_PER_S * _MB
    a, at = size.csr_bytes, size.csr_t_bytes
    cpu = CPU_SPMV_GB_PER_S * 1e9
    if stage == "generate":
        seconds = a / io + 4 * a / cpu  # ray tracing costs a few SpMVs' worth
    elif stage == "convert":
        seconds = 2 * a / io + a / cpu  # read, validate, write
    elif stage == "norm":
        seconds = a / io + a / cpu
    elif stage == "transpose":
        seconds = (a + at) / io + 2 * a / cpu
    elif stage == "partition":
        if stored_transpose:  # the parts' A_k^T: read A^T, write it split
            seconds = (2 * a + at) / io + a / cpu
        else:  # the row pointers (a compressed container's codes: one byte per element)
            seconds = (8 * (size.rows + size.cols) + size.nnz) / io
    elif stage == "simulate":
        seconds = a / io + a / cpu
    elif stage in ("mlem", "bench"):
        bp_bytes = at if stored_transpose else a
        per_iteration = a + bp_bytes
        rate = cpu if backend == "cpu" else GPU_SPMV_GB_PER_S * 1e9 * parts
        load = (a + (at if stored_transpose else 0)) / io
        seconds = load + iterations * repetitions * per_iteration / rate
    else:  # summary
        seconds = 60.0
    return math.ceil((MIN_RUNTIME_MIN + TIME_SAFETY * seconds / 60.0) * attempt)


def stage_resources(
    stage: str,
    size: MatrixSize,
    *,
    iterations: int = 1,
    repetitions: int = 1,
    parts: int = 1,
    backend: str = "cpu",
    gpus: int = 0,
    stored_transpose: bool = True,
    threads: int = 1,
    attempt: int = 1,
    source_format: str = "csr",
) -> dict[str, int]:
    """All scheduler resources of one job: ``mem_mb``, ``runtime``, ``gpu`` (+ ``cpus_per_gpu``).

    ``gpu`` is ``gpus_for(backend, gpus)``; ``cpus_per_gpu`` (:data:`CPUS_PER_GPU`)
    appears only when ``gpu > 0``, so CPU-only jobs ask for no GPU at all.
    """
    resources = {
        "mem_mb": estimate_mem_mb(
            stage,
            size,
            parts=parts,
            backend=backend,
            stored_transpose=stored_transpose,
            threads=threads,
            attempt=attempt,
            source_format=source_format,
        ),
        "runtime": estimate_runtime_min(
            stage,
            size,
            iterations=iterations,
            repetitions=repetitions,
            parts=parts,
            backend=backend,
            stored_transpose=stored_transpose,
            attempt=attempt,
        ),
        "gpu": gpus_for(backend, gpus),
    }
    if resources["gpu"]:
        resources["cpus_per_gpu"] = CPUS_PER_GPU
    return resources


# --- what each stage needs, and whether the node holds it ------------------------------

#: Bytes of the matrix arrays per non-zero and per row, by container format (each format's
#: ``bytes_per_nnz`` and ``row_bytes``, :mod:`mlemlib.formats.spec`): CSR's int32 column + float32
#: value and int64 row pointer; the compressed formats' measured 5.03 and 3.03 bytes per non-zero
#: (docs/formats.md; the markers of large column jumps included, rounded up) and their two-level
#: row pointer (plus the float32 row scale of the 16-bit formats).
FORMAT_BYTES: dict[str, tuple[float, float]] = {f.name: (f.bytes_per_nnz, f.row_bytes) for f in ALL_FORMATS}
#: What a ``plan.json`` or a small table takes on disk (bytes).
SMALL_FILE_BYTES = 1 << 16

_GB = 1e9


def matrix_bytes(size: MatrixSize, fmt: str = "csr") -> int:
    """Bytes of a matrix's arrays in format ``fmt`` (``csr`` or a compressed format).

    The container on disk is this plus a few kB of HDF5 metadata; a ``.csr4``
    is the CSR size plus its header.
    """
    if fmt not in FORMAT_BYTES:
        raise ConfigError("format", f"unknown matrix format {fmt!r}, expected one of {', '.join(FORMAT_BYTES)}")
    per_nnz, per_row = FORMAT_BYTES[fmt]
    return math.ceil(per_nnz * size.nnz + per_row * (size.rows + 1))


@dataclass(frozen=True)
class StageNeed:
    """What one job of a stage needs: disk it writes, peak host memory, GPU memory per GPU.

    Attributes
    ----------
    stage
        The rule's name (``generate_container``, ``run_mlem``, ...).
    label
        Which job: matrix, part count, run (for the table and messages).
    disk_bytes
        Bytes its outputs take (they stay on disk).
    host_bytes
        Modelled peak host memory (:func:`peak_host_bytes` plus :data:`BASE_MB`).
    gpu_bytes
        Device memory per GPU (0 for CPU stages).
    gpus
        GPUs it occupies.
    mem_mb
        Host memory the job asks a scheduler for (:func:`estimate_mem_mb`, with the safety factor).
    done
        Whether its outputs exist already (they need no new disk).
    """

    stage: str
    label: str
    disk_bytes: int
    host_bytes: int
    gpu_bytes: int = 0
    gpus: int = 0
    mem_mb: int = 0
    done: bool = False


def stage_need(
    stage: str,
    rule: str,
    label: str,
    size: MatrixSize,
    *,
    disk_bytes: int,
    parts: int = 1,
    backend: str = "cpu",
    gpus: int = 0,
    stored_transpose: bool = True,
    threads: int = 1,
    device_format: str = "csr",
    source_format: str = "csr",
    done: bool = False,
) -> StageNeed:
    """The :class:`StageNeed` of one job of model ``stage`` (see :func:`peak_host_bytes`)."""
    peak = peak_host_bytes(
        stage, size, parts=parts, backend=backend, stored_transpose=stored_transpose, threads=threads,
        source_format=source_format,
    )
    gpu_job = backend != "cpu" and stage in ("mlem", "bench") and gpus > 0
    base = BASE_MB + (GPU_BASE_MB if gpu_job else 0)
    gpu_bytes = 0
    if gpu_job:
        gpu_bytes = estimate_gpu_mem_mb(size, parts=parts, stored_transpose=stored_transpose, fmt=device_format) * _MB
    return StageNeed(
        stage=rule,
        label=label,
        disk_bytes=int(disk_bytes),
        host_bytes=int(peak + base * _MB),
        gpu_bytes=int(gpu_bytes),
        gpus=gpus if gpu_job else 0,
        mem_mb=estimate_mem_mb(
            stage, size, parts=parts, backend=backend, stored_transpose=stored_transpose, threads=threads,
            source_format=source_format,
        ),
        done=done,
    )


@dataclass(frozen=True)
class NodeLimits:
    """What the machine (or a SLURM node) offers the workflow's jobs; None where unknown.

    Attributes
    ----------
    disk_free_bytes
        Free space of the file system of the results.
    host_bytes
        Host memory of one node.
    gpu_bytes
        Memory of one GPU.
    gpus
        GPUs of one node.
    slurm_mem_mb, slurm_gpus
        The global limits given to Snakemake (``--resources mem_mb=... gpu=...``), if any.
    sources
        Where each value came from (``detected``, ``config``, ``unknown``).
    """

    disk_free_bytes: int | None = None
    host_bytes: int | None = None
    gpu_bytes: int | None = None
    gpus: int | None = None
    slurm_mem_mb: int | None = None
    slurm_gpus: int | None = None
    sources: dict = None  # type: ignore[assignment]


def host_memory_bytes(meminfo: str | os.PathLike = "/proc/meminfo") -> int | None:
    """``MemTotal`` of ``/proc/meminfo`` in bytes, or None where there is none."""
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def gpu_facts() -> tuple[int | None, int | None]:
    """``(gpus, bytes of the smallest GPU)`` from NVML (nvidia-ml-py), or ``(None, None)`` without it."""
    try:
        import pynvml
    except ImportError:
        return None, None
    try:
        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
            sizes = [pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).total for i in range(count)]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no driver, no device: unknown
        return None, None
    return count, (min(sizes) if sizes else None)


def detect_node(
    directory: str | os.PathLike = ".",
    *,
    host_memory_gb: float | str = "auto",
    gpu_memory_gb: float | str = "auto",
    gpus: int | str = "auto",
    disk_free_gb: float | str = "auto",
    slurm_mem_mb: int | None = None,
    slurm_gpus: int | None = None,
) -> NodeLimits:
    """The node's limits: each configured number, else detected here (``auto``), else unknown.

    ``auto`` detects on the machine that builds the DAG: free disk of
    ``directory`` (its nearest existing parent), host memory from
    ``/proc/meminfo``, GPUs and their memory from NVML where nvidia-ml-py and
    a driver are present. Give numbers where the jobs run elsewhere (a SLURM
    compute node) or detection is impossible.
    """
    import shutil

    sources = {}

    def pick(name, value, detect, scale):
        if value not in ("auto", None):
            sources[name] = "config"
            return int(float(value) * scale)
        got = detect()
        sources[name] = "detected" if got is not None else "unknown"
        return got

    def free_disk():
        d = Path(directory).resolve()
        while not d.exists() and d != d.parent:
            d = d.parent
        try:
            return int(shutil.disk_usage(d).free)
        except OSError:
            return None

    facts: list = []

    def nvml():
        if not facts:
            facts.extend(gpu_facts())
        return facts

    return NodeLimits(
        disk_free_bytes=pick("disk", disk_free_gb, free_disk, _GB),
        host_bytes=pick("host memory", host_memory_gb, host_memory_bytes, _GB),
        gpu_bytes=pick("GPU memory", gpu_memory_gb, lambda: nvml()[1], _GB),
        gpus=pick("GPUs", gpus, lambda: nvml()[0], 1),
        slurm_mem_mb=slurm_mem_mb,
        slurm_gpus=slurm_gpus,
        sources=sources,
    )


def _gb(b: float) -> str:
    """Bytes in GB (10^9), or MB below 1 GB."""
    return f"{b / _GB:.1f} GB" if abs(b) >= _GB else f"{b / 1e6:.1f} MB"


def shortfalls(needs: list[StageNeed], node: NodeLimits, *, scheduler: bool = False) -> list[str]:
    """One line per stage the node cannot hold, naming the stage and the shortfall; empty if all fit.

    Disk is cumulative: every output stays, so the stages not yet done must
    fit the free disk together; the line names the first stage whose outputs
    no longer fit. Host memory is each job's modelled peak against the node's
    memory (with ``scheduler``, the job's request ``mem_mb``, which a SLURM
    node must grant); GPU memory each GPU's share against one GPU's memory;
    GPUs against the node's GPUs and ``--resources gpu``.
    """
    out = []
    if node.disk_free_bytes is not None:
        used = 0
        for need in needs:
            if need.done:
                continue
            used += need.disk_bytes
            if used > node.disk_free_bytes:
                out.append(
                    f"stage {need.stage} ({need.label}) writes {_gb(need.disk_bytes)}, and the stages up to it "
                    f"{_gb(used)}; the disk has {_gb(node.disk_free_bytes)} free (short by "
                    f"{_gb(used - node.disk_free_bytes)})"
                )
                break
    for need in needs:
        where = f"stage {need.stage} ({need.label})"
        if node.host_bytes is not None:
            asked = need.mem_mb * _MB if scheduler else need.host_bytes
            what = f"asks for mem_mb={need.mem_mb}" if scheduler else f"needs {_gb(asked)} of host memory"
            if asked > node.host_bytes:
                out.append(f"{where} {what}, the node has {_gb(node.host_bytes)} (short by {_gb(asked - node.host_bytes)})")
        if node.slurm_mem_mb is not None and need.mem_mb > node.slurm_mem_mb:
            out.append(
                f"{where} asks for mem_mb={need.mem_mb}, --resources gives mem_mb={node.slurm_mem_mb} "
                f"(short by {need.mem_mb - node.slurm_mem_mb} MB)"
            )
        if need.gpus:
            if node.gpus is not None and need.gpus > node.gpus:
                out.append(f"{where} needs {need.gpus} GPUs, the node has {node.gpus}")
            if node.slurm_gpus is not None and need.gpus > node.slurm_gpus:
                out.append(f"{where} needs {need.gpus} GPUs, --resources gives gpu={node.slurm_gpus}")
            if node.gpu_bytes is not None and need.gpu_bytes > node.gpu_bytes:
                out.append(
                    f"{where} needs {_gb(need.gpu_bytes)} of GPU memory per GPU, the node's GPUs have "
                    f"{_gb(node.gpu_bytes)} (short by {_gb(need.gpu_bytes - node.gpu_bytes)})"
                )
    return out


def needs_table(needs: list[StageNeed], node: NodeLimits) -> str:
    """The stages' needs and the node's limits as a fixed-width table (logged before any job runs)."""
    rows = [("stage", "job", "disk", "host memory", "mem_mb", "GPU memory/GPU", "GPUs", "")]
    for need in needs:
        rows.append(
            (
                need.stage,
                need.label,
                _gb(need.disk_bytes),
                _gb(need.host_bytes),
                str(need.mem_mb),
                _gb(need.gpu_bytes) if need.gpus else "-",
                str(need.gpus) if need.gpus else "-",
                "(done)" if need.done else "",
            )
        )
    todo = sum(n.disk_bytes for n in needs if not n.done)
    src = node.sources or {}

    def lim(value, key, fmt=_gb):
        return f"{fmt(value)} ({src.get(key, 'config')})" if value is not None else "unknown"

    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.append(
        f"still to write {_gb(todo)}; node: disk free {lim(node.disk_free_bytes, 'disk')}, "
        f"host memory {lim(node.host_bytes, 'host memory')}, GPU memory {lim(node.gpu_bytes, 'GPU memory')}, "
        f"GPUs {lim(node.gpus, 'GPUs', str)}"
    )
    return "\n".join(lines)
