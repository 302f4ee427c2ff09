"""The kernel registry: every SpMV kernel declared once (host side; no CuPy or GPU needed).

A kernel is what a run's ``fp:`` or ``bp:`` names. Each :class:`Kernel`
records its name, the operation it computes, the matrix formats it reads,
the backend that has it (``cpu``; ``cuda`` on one GPU and, where
``layouts`` says so, on several), whether it is deterministic, whether a
CUDA graph can capture it, and where its code is. ``auto`` and the
``notrans`` selector are resolved here too (:func:`resolve`,
:func:`choose_notrans`), from facts about the matrix and the device that the
backend passes in, so one GPU and N GPUs pick by the same rules.

Everything that names kernels reads this module: the CPU, CUDA and NCCL
backends (:func:`resolve`), ``mlem bench spmv`` (:func:`names`,
:func:`get`), the workflow's config check (:func:`check_run`), the config
schema's ``enum`` (a test keeps it equal to :func:`all_names`) and
``mlem kernels`` (:func:`table`).

Operations
----------
``forward``       ``fp = A f`` on the rows of ``A``.
``back``          ``bp = A^T c`` on the rows of a stored transpose ``A^T``.
``back_notrans``  ``bp = A^T c`` from the rows of ``A`` (no transpose stored).
``iteration``     a whole MLEM iteration in one kernel (one pass over ``A``).
"""

from __future__ import annotations

import functools
import importlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from mlemlib.errors import ConfigError
from mlemlib.formats.spec import ALL_FORMATS, NAMES, matrix_format_of

OPS = ("forward", "back", "back_notrans", "iteration")
#: Backend names of the config (``backend:``). ``cuda`` with ``gpus > 1`` runs the NCCL backend.
BACKENDS = ("cpu", "cuda")
#: Matrix formats on the device (the matrix file's format: ``mlem convert --format``; each one's
#: description: :func:`mlemlib.formats.spec.matrix_format_of`).
FORMATS = NAMES
_CSR = tuple(f.name for f in ALL_FORMATS if not f.compressed)
_CMP = tuple(f.name for f in ALL_FORMATS if f.compressed)
_ALL = FORMATS
#: Multi-GPU layouts of the NCCL backend.
LAYOUTS = ("local", "thesis")
#: Most non-zeros cuSPARSE takes through CuPy (32-bit indices).
CUSPARSE_MAX_NNZ = 2**31 - 1
#: Share of ``scatter_smem``'s row chunks whose columns must fit shared memory for ``notrans`` to take it.
SMEM_LOCAL_MIN = 0.5
#: Least voxel reuse of the row chunks (non-zeros per voxel and chunk, sampled) at which ``auto``
#: takes ``onepass_chunked``: below it the chunks' global atomics cost more than the pair's second read.
CHUNK_REUSE_MIN = 8.0
#: The same where the other choice is ``onepass_fixed`` (a compressed matrix without a transpose): the
#: fixed-point pass is bound by its 64-bit atomics, so the chunks win at a lower reuse (an OSEM subset's).
CHUNK_REUSE_MIN_ONEPASS = 4.0
#: Least chunks per multiprocessor of each GPU (one block each) at which ``auto`` takes
#: ``onepass_chunked`` over the csr_vector pair when a transpose is there: below, most of the GPU waits
#: for a few blocks.
CHUNK_WAVES_MIN = 4


@dataclass(frozen=True)
class Kernel:
    """One kernel of one backend.

    Attributes
    ----------
    name
        What ``fp:`` / ``bp:`` say.
    op
        One of :data:`OPS`.
    backend
        ``cpu`` or ``cuda``.
    formats
        Matrix formats it reads.
    deterministic
        False where floating-point atomics (or a library that uses them) make
        the last bits vary run after run.
    any_gpu_count
        Its images are the same bits on every GPU count: the back projection is
        summed as 64-bit fixed point and the GPUs' sums all-reduced as integers.
        The other deterministic cuda kernels repeat their bits run after run on
        one GPU count, but on several GPUs in the ``local`` layout the all-reduce
        adds the GPUs' float partial back projections, so their last bits depend
        on the GPU count.
    layouts
        Multi-GPU layouts it runs in (``()``: one GPU only; always ``()`` on the cpu).
    graph
        Whether a CUDA graph can capture it (no allocation inside).
    source
        Where its code is (``kernels/spmv.cu: csr_vector_L``, a library call...).
    summary
        One line for the table.
    selector
        True for a name that picks another kernel of the same operation once
        the matrix is loaded (``notrans``, see :func:`choose_notrans`).
    launcher
        ``module:function`` under ``mlemlib.backends`` that launches it
        (:func:`launcher` binds it, the kernel's name as ``kernel=``): one
        hand-off from this entry to the launch, one more to the ``.cu``.
    fused
        Its epilogue fuses the correlation (forward) or the update (back
        projection on ``A^T``) into the projection.
    chunks
        It reads the matrix as row chunks with their voxel lists (the
        chunked layout, :mod:`mlemlib.chunked`), not as rows.
    smem
        It needs the shared-memory plan of the matrix's row chunks
        (``scatter_smem``), made once per matrix.
    shapes
        Its launch shape is timed on each matrix at set-up (``csr_vector``).
    lanes
        It takes a number of lanes per row (``lanes:``).
    secsize
        It takes a section size (``secsize:``, ``merge``).
    blocks
        Without a transpose it scatters into per-block images summed in
        block order (the CPU's deterministic scatter; ``blocks:``).
    interleaved
        It reads its matrix's rows best lane-interleaved (``DeviceCSR.set_layout``), where it is
        that matrix's one reader.
    limits
        Its launcher takes the fixed point's add limits (``limits=``,
        :func:`mlemlib.backends._compressed_cuda.fixed_limits`), which the backend computes once
        from the longest column of each GPU's rows (the chunked kernel: from the chunks holding
        each voxel).
    """

    name: str
    op: str
    backend: str
    formats: tuple[str, ...]
    deterministic: bool
    layouts: tuple[str, ...]
    graph: bool
    source: str
    summary: str
    selector: bool = False
    launcher: str = ""
    fused: bool = False
    chunks: bool = False
    smem: bool = False
    shapes: bool = False
    lanes: bool = False
    secsize: bool = False
    blocks: bool = False
    interleaved: bool = False
    limits: bool = False
    any_gpu_count: bool = False

    @property
    def needs_transpose(self) -> bool:
        """Whether it reads a stored ``A^T``."""
        return self.op == "back"


_SPMV = "mlemlib/kernels/spmv.cu"
_CMPCU = "mlemlib/kernels/compressed.cu"
_CMPCPU = "mlemlib/backends/_compressed_cpu.py"
_CPU = "mlemlib/backends/cpu.py"
_BOTH = ("local", "thesis")
_LOCAL = ("local",)

#: Every kernel, once. Order: backend, then operation, then the table's order.
KERNELS: tuple[Kernel, ...] = (
    # ---- cpu
    Kernel("numba", "forward", "cpu", _ALL, True, (), False, f"{_CPU}: _spmv32/_spmv64; {_CMPCPU}: cmp_spmv32",
           "row-parallel SpMV (prange over rows, each row summed in order; compressed rows decoded on the fly)",
           launcher="cpu:numba_forward"),
    Kernel("scipy", "forward", "cpu", _CSR, True, (), False, "scipy.sparse csr_matrix @ x",
           "SciPy's CSR product (one thread; same sums as numba)",
           launcher="cpu:scipy_forward"),
    Kernel("numba", "back", "cpu", _ALL, True, (), False, f"{_CPU}: _spmv32/_spmv64 on A^T; {_CMPCPU}: cmp_spmv32",
           "row-parallel SpMV on the stored transpose; without one, the blocked scatter",
           launcher="cpu:numba_back", blocks=True),
    Kernel("scipy", "back", "cpu", _CSR, True, (), False, "scipy.sparse: A^T @ c (or A.T @ c)",
           "SciPy's product on the stored transpose, or its CSC product of A",
           launcher="cpu:scipy_back"),
    Kernel("notrans", "back_notrans", "cpu", _ALL, True, (), False, f"{_CPU}: _spmv_t32/_spmv_t64; {_CMPCPU}: cmp_spmv_t32",
           "scatter from the rows of A into per-block images, summed in block order (thesis ch. 7)",
           launcher="cpu:numba_back", blocks=True),
    Kernel("onepass", "iteration", "cpu", _ALL, True, (), False, f"{_CMPCPU}: csr_onepass32 / cmp_onepass32",
           "one pass over A per iteration: per row a . f, g / (a . f), and its scatter into per-block images",
           launcher="cpu:onepass_step", blocks=True),
    Kernel("onepass_chunked", "iteration", "cpu", _ALL, True, (), False, "mlemlib/chunked.py: _onepass_fixed",
           "the GPU's onepass_chunked arithmetic on the CPU (lane-order dot products, 64-bit fixed-point sums): "
           "its reference",
           launcher="cpu:chunked_step", chunks=True),
    # ---- cuda: forward
    Kernel("csr_vector", "forward", "cuda", _CSR, True, _BOTH, True, f"{_SPMV}: csr_vector_L",
           "2..32 lanes per row, 16-byte loads, warp-shuffle sum; correlation fused",
           launcher="_cuda_kernels:csr_vector", fused=True, shapes=True, lanes=True, interleaved=True),
    Kernel("csr_scalar", "forward", "cuda", _CSR, True, _BOTH, True, f"{_SPMV}: csr_scalar",
           "one thread per row (baseline); correlation fused",
           launcher="_cuda_kernels:csr_scalar", fused=True),
    Kernel("merge", "forward", "cuda", _CSR, False, _BOTH, True, f"{_SPMV}: merge_spmv",
           "merge-path SpMV of the thesis (5.1), secsize items per thread, atomics",
           launcher="_cuda_kernels:merge", secsize=True),
    Kernel("cusparse", "forward", "cuda", _CSR, False, _BOTH, False, "cupyx cuSPARSE: A @ f",
           "cuSPARSE's default SpMV through CuPy (allocates; not deterministic)",
           launcher="_cuda_kernels:cusparse"),
    Kernel("delta_vector", "forward", "cuda", _CMP, True, _BOTH, True, f"{_CMPCU}: cspmv_<kind>_L",
           "compressed rows: 4 slots per lane, warp scan of the column deltas; correlation fused",
           launcher="_compressed_cuda:spmv", fused=True, lanes=True),
    # ---- cuda: back projection on the stored transpose
    Kernel("csr_vector", "back", "cuda", _CSR, True, _BOTH, True, f"{_SPMV}: csr_vector_L on A^T",
           "csr_vector on the rows of A^T (lanes capped by bandwidth per SM); update fused",
           launcher="_cuda_kernels:csr_vector", fused=True, shapes=True, lanes=True, interleaved=True),
    Kernel("csr_scalar", "back", "cuda", _CSR, True, _BOTH, True, f"{_SPMV}: csr_scalar on A^T",
           "one thread per row of A^T; update fused",
           launcher="_cuda_kernels:csr_scalar", fused=True),
    Kernel("merge", "back", "cuda", _CSR, False, _BOTH, True, f"{_SPMV}: merge_spmv on A^T",
           "merge-path SpMV on A^T, atomics",
           launcher="_cuda_kernels:merge", secsize=True),
    Kernel("cusparse", "back", "cuda", _CSR, False, _BOTH, False, "cupyx cuSPARSE: A_T @ c",
           "cuSPARSE's SpMV on the stored transpose",
           launcher="_cuda_kernels:cusparse"),
    Kernel("delta_vector", "back", "cuda", _CMP, True, _BOTH, True, f"{_CMPCU}: cspmv_<kind>_L on A^T",
           "delta_vector on the rows of A^T (stored as CSR, compressed when uploaded); update fused",
           launcher="_compressed_cuda:spmv", fused=True, lanes=True),
    # ---- cuda: back projection without a transpose
    Kernel("scatter", "back_notrans", "cuda", _CSR, False, _LOCAL, True, f"{_SPMV}: scatter_L",
           "the thesis's atomic scatter from the rows of A (lanes per row, one element per lane per trip)",
           launcher="_cuda_kernels:scatter_atomic", lanes=True),
    Kernel("scatter_vec", "back_notrans", "cuda", _CSR, False, _LOCAL, True, f"{_SPMV}: scatter_vec_L",
           "atomic scatter with 2/4-wide vector atomics (sm_90)",
           launcher="_cuda_kernels:scatter_vec", lanes=True),
    Kernel("scatter_smem", "back_notrans", "cuda", _CSR, False, _LOCAL, True, f"{_SPMV}: scatter_smem",
           "per row chunk, atomics into a shared-memory window where its columns fit",
           launcher="_cuda_kernels:scatter_smem", smem=True),
    Kernel("cusparse_notrans", "back_notrans", "cuda", _CSR, False, _LOCAL, False, "cupyx cuSPARSE: A.T @ c",
           "cuSPARSE's transposed product through CuPy (allocates), a reference for the scatters",
           launcher="_cuda_kernels:cusparse_scatter"),
    Kernel("notrans", "back_notrans", "cuda", _CSR, False, _LOCAL, True, "see choose_notrans",
           "scatter_smem where most row chunks fit shared memory, else scatter", selector=True,
           launcher="_cuda_kernels:notrans", smem=True),
    Kernel("delta_scatter", "back_notrans", "cuda", _CMP, False, _LOCAL, True, f"{_CMPCU}: cscatter_<kind>_L",
           "atomic scatter from compressed rows of A",
           launcher="_compressed_cuda:scatter"),
    # ---- cuda: one pass over A per iteration
    Kernel("onepass", "iteration", "cuda", _ALL, False, _LOCAL, True,
           f"{_CMPCU}: onepass_csr_L / conepass_<kind>_L",
           "one pass over A: per row a . f (row kept in registers), g / (a . f), float atomics into bp",
           launcher="_compressed_cuda:onepass_step"),
    Kernel("onepass_fixed", "iteration", "cuda", _ALL, True, _LOCAL, True,
           f"{_CMPCU}: onepass_det_csr_L / conepass_det_<kind>_L",
           "onepass with bp summed as 64-bit fixed point (order-independent: bit-identical for any GPU count)",
           launcher="_compressed_cuda:onepass_fixed_step", limits=True, any_gpu_count=True),
    Kernel("onepass_chunked", "iteration", "cuda", _ALL, True, _LOCAL, True, f"{_CMPCU}: chunked_onepass / _f16 / _u16",
           "one pass through row chunks of a reordered A (mlemlib/chunked.py): f and each chunk's sums in shared "
           "memory, 64-bit fixed point (deterministic), one global atomic per voxel and chunk; 6 bytes per nnz "
           "(4 with a compressed-f16 or compressed-u16 matrix's 16-bit values) plus voxel lists",
           launcher="_compressed_cuda:chunked_step", chunks=True, limits=True, any_gpu_count=True),
)

_INDEX = {(k.backend, k.op, k.name): k for k in KERNELS}

#: What ``auto`` means, in words (``mlem kernels`` prints it; :func:`resolve` implements it).
AUTO_RULES = (
    "cpu fp: numba with several Numba threads, scipy with one (identical sums)",
    "cpu bp: like fp on a stored transpose; numba's blocked scatter without one",
    "cpu with a compressed matrix: numba (scipy reads CSR only)",
    "cuda fp (1 and N GPUs): csr_vector (delta_vector on a compressed matrix)",
    "cuda bp (1 and N GPUs): csr_vector (delta_vector) on A^T when a transpose is available (stored; a CSR "
    "matrix of < 2^31 non-zeros, or a CSR block in the local layout, is transposed on the GPU) and A and A^T fit "
    "the GPU, else notrans (onepass_fixed on a compressed matrix)",
    "bp naming a whole-iteration kernel (onepass, onepass_fixed) runs the iteration in one pass; fp is then auto",
    "cuda notrans: scatter_smem when >= 50% of its row chunks fit shared memory, else scatter",
    "cuda bp=auto (and fp=auto), 1 and N GPUs (local layout), any format: onepass_chunked when the row chunks of "
    "a sample block of the matrix reuse each voxel >= 8 times (a matrix in the reorder stage's order); with a "
    "transpose only when each GPU's rows make >= 4 chunks per multiprocessor (else the csr_vector pair)",
    "cuda csr_vector launch shape: the fastest of _cuda_plan.SHAPE_CANDIDATES, timed on each matrix (and each "
    "GPU's block) at set-up; a shape never changes a result",
)


def launcher(k: Kernel) -> Callable[..., Any]:
    """The function that launches ``k`` (its :attr:`Kernel.launcher`), with ``kernel=k.name`` bound.

    The one place a kernel's name meets its code: the backends call what this
    returns (imported on first use, so this module needs no GPU).

    Raises
    ------
    ConfigError
        A kernel without a launcher (the CPU's).
    """
    return _launcher(k.launcher, k.name)


@functools.cache
def _launcher(path: str, name: str) -> Callable[..., Any]:
    if not path:
        raise ConfigError("kernel", f"kernel {name!r} has no launcher of its own (a CPU kernel)")
    mod, fn = path.split(":")
    return functools.partial(getattr(importlib.import_module(f"mlemlib.backends.{mod}"), fn), kernel=name)


def get(backend: str, op: str, name: str) -> Kernel:
    """The kernel ``name`` of ``op`` on ``backend``; :class:`ConfigError` if there is none."""
    try:
        return _INDEX[(backend, op, name)]
    except KeyError:
        raise ConfigError(op, f"no {op} kernel {name!r} on backend {backend}") from None


def names(backend: str, *ops: str, gpus: int = 1, layout: str | None = None, fmt: str | None = None) -> list[str]:
    """Kernel names of ``backend`` for the operations ``ops``, in table order, without duplicates.

    With ``gpus > 1`` only kernels of ``layout`` (or of any layout) are listed;
    with ``fmt`` only kernels that read that format.
    """
    out: list[str] = []
    for k in KERNELS:
        if k.backend != backend or (ops and k.op not in ops) or k.name in out:
            continue
        if gpus > 1 and not (k.layouts if layout is None else layout in k.layouts):
            continue
        if fmt is not None and fmt not in k.formats:
            continue
        out.append(k.name)
    return out


#: The operations a config key names: ``bp`` also names whole-iteration kernels (``fp`` is then ``auto``).
KEY_OPS = {"fp": ("forward",), "bp": ("back", "back_notrans", "iteration")}


def all_names(key: str) -> list[str]:
    """Every name ``fp`` (``key="fp"``) or ``bp`` may take on any backend, ``auto`` first (the schema's enum)."""
    ops = KEY_OPS[key]
    out = ["auto"]
    for backend in BACKENDS:
        out += [n for n in names(backend, *ops) if n not in out]
    return out


def _valid(key: str, backend: str, gpus: int, layout: str | None, fmt: str | None = None) -> list[str]:
    ops = KEY_OPS[key]
    return ["auto"] + names(backend, *ops, gpus=gpus, layout=layout, fmt=fmt)


def check(key: str, name: str | None, backend: str, *, gpus: int = 1, layout: str | None = None,
          where: str | None = None, fmt: str | None = None) -> str:
    """Check one ``fp``/``bp`` name for a backend, GPU count and layout; return it (``auto`` for None).

    Raises
    ------
    ConfigError
        One line naming the key (``where`` or ``key``) and listing the valid names.
    """
    name = "auto" if name is None else str(name)
    if backend not in BACKENDS:
        raise ConfigError(where or "backend", f"unknown backend {backend!r}, expected one of {', '.join(BACKENDS)}")
    valid = _valid(key, backend, gpus, layout, fmt)
    if name in valid:
        return name
    what = "forward-projection" if key == "fp" else "back-projection"
    if fmt is not None and name in _valid(key, backend, gpus, layout):
        fault = f"{what} kernel {name!r} of backend {backend} does not read the {fmt} format"
    elif name in _valid(key, backend, 1, None):
        scope = f"{gpus} GPUs" + (f" in the {layout} layout" if layout else "")
        fault = f"{what} kernel {name!r} of backend {backend} does not run on {scope}"
    else:
        fault = f"unknown {what} kernel {name!r} for backend {backend}"
    raise ConfigError(where or key, f"{fault}; valid: {', '.join(valid)} (mlem kernels lists them)")


def check_run(run: dict, where: str = "run", formats: tuple[str, ...] = ("csr",)) -> None:
    """Check a config ``runs:`` entry's ``fp``/``bp`` against its backend, every GPU count, layout and matrix format.

    ``formats`` are the formats of the matrices the run will read (the
    ``format`` of each configured matrix).

    Raises
    ------
    ConfigError
        Naming ``where.fp`` or ``where.bp``.
    """
    backend = run.get("backend", "cpu")
    gpus = run.get("gpus", 1)
    layouts = run.get("layout", "local")
    for fmt in formats:
        for g in gpus if isinstance(gpus, list) else [gpus]:
            for lay in (layouts if isinstance(layouts, list) else [layouts]) if int(g) > 1 else [None]:
                for key in ("fp", "bp"):
                    check(key, run.get(key), backend, gpus=int(g), layout=lay, where=f"{where}.{key}", fmt=fmt)


def choose_notrans(local_fraction: float) -> str:
    """The no-transpose back projection that ``notrans`` (and ``auto`` without ``A^T``) take on cuda.

    ``scatter_smem`` when at least :data:`SMEM_LOCAL_MIN` of its row chunks
    accumulate in shared memory (rows whose columns stay in a window, as in
    sinogram order); otherwise the atomic ``scatter``: one element per lane,
    so a warp's atomics cover consecutive columns, about as fast as
    cuSPARSE's transposed product and, unlike it through CuPy, for any
    number of non-zeros and GPUs.
    """
    return "scatter_smem" if local_fraction >= SMEM_LOCAL_MIN else "scatter"


def may_chunk(fp: str | None, bp: str | None, choice: Choice) -> bool:
    """Whether ``auto`` may still take ``onepass_chunked`` (:func:`choose_auto`) over ``choice``, what
    :func:`resolve` gave: ``bp`` is ``auto``, and ``fp`` is too or the back projection reads no transpose
    (a forward kernel the user named keeps its pair)."""
    return bp in ("auto", None) and (fp in ("auto", None) or not choice.needs_transpose)


def choose_auto(reuse: float | None, *, transpose: bool, chunks: float | None = None, sms: int | None = None,
                fmt: str = "csr", gpus: int = 1, layout: str | None = None, fits: bool = True) -> str:
    """What ``bp=auto`` (with ``fp=auto``) runs on cuda, on 1 and on N GPUs: one rule for every GPU count.

    ``onepass_chunked`` (the whole iteration, deterministic) when the chunks
    of a sample block reuse each voxel at least :data:`CHUNK_REUSE_MIN`
    times (:data:`CHUNK_REUSE_MIN_ONEPASS` on a compressed ``fmt`` without a
    transpose, where the other choice is ``onepass_fixed``) (a matrix in the reorder stage's order;
    :func:`mlemlib.chunked.sample_chunks`) and the layout is ``local`` (or
    one GPU). With a transpose (``transpose``: the ``csr_vector`` pair can
    run) it also needs :data:`CHUNK_WAVES_MIN` blocks per multiprocessor on
    each GPU (``chunks`` estimated for the whole matrix, split over ``gpus``;
    ``sms`` of the device; a block per chunk): a small share leaves most of
    the GPU idle, where the pair does not. Else what :func:`resolve` gives
    ``auto`` (the pair, ``delta_vector`` on a compressed ``fmt``, or without
    a transpose ``notrans`` / ``onepass_fixed``). ``None`` reuse (no sample:
    an empty matrix) counts as no reuse.
    """
    gpus = max(1, int(gpus))
    one_pass = get_bp("cuda", matrix_format_of(fmt).notrans_kernel).op == "iteration"  # the choice without A^T
    least = CHUNK_REUSE_MIN_ONEPASS if one_pass and not transpose else CHUNK_REUSE_MIN
    if reuse is not None and reuse >= least and (gpus == 1 or layout in (None, "local")):
        per_gpu = chunks / gpus if chunks is not None else None
        if not transpose or (per_gpu is not None and sms is not None and per_gpu >= CHUNK_WAVES_MIN * sms):
            return "onepass_chunked"
    return resolve("cuda", "auto", "auto", gpus=gpus, layout=layout if gpus > 1 else None,
                   transpose_available=transpose, fits=fits, fmt=fmt).bp


@dataclass(frozen=True)
class Choice:
    """The kernels a backend runs, resolved from the user's names.

    ``bp`` may still be the selector ``notrans``: the backend replaces it with
    :func:`choose_notrans` once ``A`` is on its device.
    """

    fp: str
    bp: str
    needs_transpose: bool
    deterministic: bool

    def settle(self, bp: str) -> Choice:
        """This choice with ``notrans`` replaced by the kernel it chose."""
        return Choice(self.fp, bp, self.needs_transpose, self.deterministic and get_bp("cuda", bp).deterministic)


def get_bp(backend: str, name: str) -> Kernel:
    """The kernel ``bp`` names: a back projection (on ``A^T`` or without it) or a whole iteration."""
    k = (_INDEX.get((backend, "back", name)) or _INDEX.get((backend, "back_notrans", name))
         or _INDEX.get((backend, "iteration", name)))
    if k is None:
        raise ConfigError("bp", f"no back-projection kernel {name!r} on backend {backend}")
    return k


def resolve(backend: str, fp: str | None, bp: str | None, *, gpus: int = 1, layout: str | None = None,
            transpose_available: bool = True, fits: bool = True, threads: int = 1, fmt: str = "csr") -> Choice:
    """Resolve ``fp``/``bp`` names (``auto`` included) to the kernels a backend runs.

    Parameters
    ----------
    backend
        ``cpu`` or ``cuda``.
    fp, bp
        The user's names (None: ``auto``).
    gpus, layout
        GPU count and multi-GPU layout (cuda).
    transpose_available
        Whether ``A^T`` is stored (or, on several GPUs, its parts can be made).
    fits
        Whether ``A`` and ``A^T`` both fit the device memory (cuda).
    threads
        Numba threads (cpu ``auto``).
    fmt
        The matrix format on the device; only kernels that read it are valid.

    Raises
    ------
    ConfigError
        A name the backend, GPU count or layout does not have.
    """
    multi = gpus > 1
    lay = layout if multi else None
    fp = check("fp", fp, backend, gpus=gpus, layout=lay, fmt=fmt)
    bp = check("bp", bp, backend, gpus=gpus, layout=lay, fmt=fmt)
    kb = get_bp(backend, bp) if bp != "auto" else None
    if kb is not None and kb.op == "iteration":  # a whole iteration: fp must say nothing else
        if fp not in ("auto", bp):
            raise ConfigError("fp", f"bp={bp} runs the whole iteration in one pass over A: fp must be auto or {bp}, "
                                    f"not {fp!r}")
        return Choice(bp, bp, False, kb.deterministic)
    if backend == "cpu":
        auto = "numba" if threads > 1 or fmt not in get("cpu", "forward", "scipy").formats else "scipy"
        fp = auto if fp == "auto" else fp
        if bp == "auto":
            bp = auto if transpose_available else "numba"
        kb = get_bp("cpu", bp)
        needs_t = transpose_available and kb.op == "back"
        return Choice(fp, bp, needs_t, get("cpu", "forward", fp).deterministic and kb.deterministic)
    spec = matrix_format_of(fmt)
    fp = spec.row_kernel if fp == "auto" else fp
    if bp == "auto":
        bp = spec.row_kernel if transpose_available and fits else spec.notrans_kernel
        if layout == "thesis" and multi and get_bp("cuda", bp).op != "back":
            raise ConfigError("bp", "bp=auto: the thesis layout back-projects rows of A^T, which do not fit; "
                                    "use layout local")
    kb = get_bp("cuda", bp)
    if kb.op == "iteration":
        return Choice(bp, bp, False, kb.deterministic)
    return Choice(fp, bp, kb.needs_transpose, get("cuda", "forward", fp).deterministic and kb.deterministic)


@dataclass(frozen=True)
class Decision(Choice):
    """A :class:`Choice` with how ``auto`` came to it: the chunk sample it judged (``reuse``, ``chunks``; None
    where none was taken) and ``paired``, the choice without the chunked one pass (a backend falls back to it
    where the chunks cannot be made)."""

    chunked: bool = False
    reuse: float | None = None
    chunks: float | None = None
    paired: Choice | None = None


def check_layout(layout: str) -> str:
    """``layout`` where it is one of :data:`LAYOUTS`, else a one-line :class:`ConfigError` naming ``layout``."""
    if layout not in LAYOUTS:
        raise ConfigError("layout", f"unknown layout {layout!r}, expected one of {', '.join(LAYOUTS)}")
    return layout


def decide(backend: str, fp: str | None, bp: str | None, *, fmt: str = "csr", gpus: int = 1,
           layout: str | None = None, transpose_available: bool = True, fits: bool = True, threads: int = 1,
           sample: Callable[[], tuple[float | None, float | None] | None] | None = None, sms: int | None = None,
           chunks_fit: Callable[[], bool] | None = None, check_gpus: int | None = None) -> Decision:
    """The one kernel decision of every backend (cpu, one GPU, N GPUs): the user's names, ``auto`` and the
    chunk choice, from the facts of the matrix and the device.

    :func:`resolve` gives the names (``auto``: the pair or the no-transpose choice); where ``auto`` may
    still take ``onepass_chunked`` (:func:`may_chunk`, the cuda backend, the local layout) and ``sample``
    is given, its chunk sample (``(reuse, chunks)``, :func:`mlemlib.chunked.sample_chunks`; called only
    then) decides by :func:`choose_auto`, and ``chunks_fit`` (called only then) whether the chunks fit the
    device. The ``notrans`` selector stays for the backend to settle (:meth:`Choice.settle`) once ``A`` is
    on its device.

    Parameters
    ----------
    gpus
        GPU count (each GPU's share of the chunks is judged).
    check_gpus
        The GPU count the names are checked against (default ``gpus``; the several-GPU backend running on
        one passes 2, so that only kernels of its layout are valid).
    Others
        As :func:`resolve` and :func:`choose_auto`.

    Raises
    ------
    ConfigError
        An unknown layout, or a name the backend, GPU count, layout or format does not have (one line).
    """
    if layout is not None:
        check_layout(layout)
    checked = gpus if check_gpus is None else check_gpus
    choice = resolve(backend, fp, bp, gpus=checked, layout=layout, transpose_available=transpose_available,
                     fits=fits, threads=threads, fmt=fmt)
    plain = Decision(choice.fp, choice.bp, choice.needs_transpose, choice.deterministic,
                     chunked=get_bp(backend, choice.bp).chunks)
    if backend != "cuda" or sample is None or layout not in (None, "local") or not may_chunk(fp, bp, choice):
        return plain
    got = sample()
    reuse, chunks = got if got is not None else (None, None)
    pick = choose_auto(reuse, transpose=choice.needs_transpose, chunks=chunks, sms=sms, fmt=fmt, gpus=gpus,
                       layout=layout, fits=fits)
    if not get_bp("cuda", pick).chunks or (chunks_fit is not None and not chunks_fit()):
        return Decision(choice.fp, choice.bp, choice.needs_transpose, choice.deterministic, reuse=reuse,
                        chunks=chunks)
    c = resolve("cuda", "auto", pick, gpus=checked, layout=layout, fmt=fmt)
    return Decision(c.fp, c.bp, c.needs_transpose, c.deterministic, chunked=True, reuse=reuse, chunks=chunks,
                    paired=choice)


def kernels_of(backend: str, fp: str, bp: str) -> list[Kernel]:
    """The kernels a settled choice ``fp``/``bp`` runs: the back projection (a one pass: the whole
    iteration) and, unless it is a one pass, the forward projection."""
    kb = get_bp(backend, bp)
    return [kb] if kb.op == "iteration" else [get(backend, "forward", fp), kb]


def row_forward(fmt: str) -> Kernel:
    """The cuda forward projection a backend runs alone where its iteration is one pass (``forward()``):
    what ``auto`` takes for the format (``csr_vector``, ``delta_vector``)."""
    return get("cuda", "forward", resolve("cuda", "auto", "auto", fmt=fmt).fp)


def uses_transpose(backend: str, bp: str | None) -> bool:
    """Whether a run with back projection ``bp`` reads a stored ``A^T`` (the workflow asks before giving one).

    Every ``back`` kernel and ``auto`` do; ``back_notrans`` and whole-iteration kernels do not.
    """
    bp = "auto" if bp is None else bp
    if bp == "auto":
        return True
    k = _INDEX.get((backend, "back", bp))
    return k is not None


def table(*, as_json: bool = False) -> str:
    """The registry as a Markdown table (or JSON), with the ``auto`` rules: what ``mlem kernels`` prints."""
    if as_json:
        return json.dumps({"kernels": [asdict(k) for k in KERNELS], "auto": list(AUTO_RULES)}, indent=1)
    head = ("backend", "op", "name", "formats", "deterministic", "multi-GPU layouts", "graph", "launcher", "source")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in KERNELS:
        same_bits = ("yes, every GPU count" if k.any_gpu_count else "yes") if k.deterministic else "no"
        cells = (
            k.backend, k.op, k.name + (" (selector)" if k.selector else ""), ",".join(k.formats),
            same_bits, ",".join(k.layouts) or "-", "yes" if k.graph else "no",
            k.launcher or "-", k.source,
        )
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "auto:"] + [f"- {r}" for r in AUTO_RULES]
    single = [k for k in KERNELS if k.backend == "cuda" and not k.layouts]
    if single:
        lines += ["", "one GPU only:"] + [f"- {k.name} ({k.op}): {k.summary}" for k in single]
    return "\n".join(lines)
