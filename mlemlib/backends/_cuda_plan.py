"""Host-side planning for the CUDA kernels (pure Python/NumPy: no CuPy, no GPU).

Provides the decisions the CUDA backend and the benchmark make before a
launch, kept apart so that CI tests them without a GPU:

- :func:`choose_lanes` — lanes per row of ``csr_vector`` / ``scatter`` from the
  mean row length;
- :func:`launch_shape` — blocks and threads of a grid-stride launch from the
  device's multiprocessor count;
- :func:`spmv_bytes`, :func:`csr_bytes`, :func:`iteration_floor_bytes` — the
  bytes an SpMV or an MLEM iteration must move at least (the denominator of
  every effective bandwidth the project reports);
- :func:`merge_threads` — threads of the merge-based kernel for a ``secsize``;
- :func:`chunk_rows` — nnz-balanced row chunks of the shared-memory scatter;
- :func:`interleave_positions` — where the interleaved layout of ``csr_vector``
  (``DeviceCSR.set_layout``) stores each element of a row; :func:`row_layouts`
  — which matrices of a backend get it.

Which kernel a name means (``auto``, ``notrans``...) is decided in
:mod:`mlemlib.registry`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
import numpy as np

from mlemlib import registry
from mlemlib.backends._build import Build
from mlemlib.errors import ConfigError

#: Lanes per row ``csr_vector_L`` and ``scatter_L`` are compiled for.
LANE_CHOICES = (2, 4, 8, 16, 32)
#: Non-zeros one lane loads per 16-byte access (int4 columns, float4 values).
VECTOR_WIDTH = 4
#: Threads per block of the row kernels (their ``__launch_bounds__``).
THREADS = 256
#: The default of spmv.cu's MLEM_VEC_UNROLL (csr_vector_L's own build; RowShape.unroll).
VEC_UNROLL = 4
#: Blocks per multiprocessor slot to launch at most (the rest is grid-stride).
WAVES = 16
#: Bytes per non-zero of the CSR arrays: int32 column + float32 value.
BYTES_PER_NNZ = 8
#: The merge kernel's section size when none is given (the thesis's best on V100).
DEFAULT_SECSIZE = 5

#: Lanes per row ``csr_block_L`` is compiled for.
BLOCK_LANES = (8, 16, 32)


@dataclass(frozen=True)
class RowShape:
    """Launch shape of the row kernel ``csr_vector`` (it never changes a result, only the speed).

    Attributes
    ----------
    threads
        Threads per block (256: ``csr_vector_L``; up to 1024: ``csr_block_L``).
    sync
        Keep a block's rows in step (a barrier after each trip).
    waves
        Grid cap in full waves of the device (None: :data:`WAVES`; 0: one
        trip per block, no grid-stride loop).
    stream
        Load the matrix's arrays with streaming (evict-first) loads, leaving
        L1 to the gathers (a separate build, ``-DMLEM_STREAM``).
    min_blocks
        Blocks of ``threads`` that must fit a multiprocessor at once (the
        register cap, ``-DMLEM_BLOCK_MINB``).
    unroll
        Trips of the 16-byte loop issued together (``-DMLEM_VEC_UNROLL``;
        :data:`VEC_UNROLL` is the build's default): 4 is faster where the
        gathers hit the cache (a matrix in its scanner's order), 2 where they do
        not and the registers it saves hide their latency (rows shuffled).
    row_bound
        0: ``csr_vector_L`` / ``csr_block_L``. Else ``csr_row_L``: one row per
        group, no loop (``waves`` and ``sync`` do not apply), compiled for
        ``min_blocks`` blocks of ``row_bound`` threads per multiprocessor
        (``-DMLEM_ROW_BOUND``): 1024 x 2 holds it to 32 registers, 64 warps
        of neighbouring rows per multiprocessor, which lets L1 serve more of
        a back projection's gathers.
    """

    threads: int = THREADS
    sync: bool = False
    waves: int | None = None
    stream: bool = False
    min_blocks: int = 1
    unroll: int = VEC_UNROLL
    row_bound: int = 0

    def __post_init__(self) -> None:
        if self.row_bound and (self.row_bound < self.threads or self.row_bound > 1024):
            raise ValueError(f"row_bound must lie in [threads, 1024] = [{self.threads}, 1024], got {self.row_bound}")

    @property
    def is_default(self) -> bool:
        """Whether this is ``csr_vector_L``'s own shape (no ``csr_block_L`` or ``csr_row_L`` needed)."""
        return self == RowShape()

    @property
    def kernel(self) -> str:
        """The kernel family this shape launches: ``csr_vector``, ``csr_block`` or ``csr_row``."""
        return "csr_vector" if self.is_default else ("csr_row" if self.row_bound else "csr_block")

    @property
    def build(self) -> Build:
        """The spmv.cu build this shape runs (the kernel cache's key)."""
        return Build("spmv", self.options())

    def options(self) -> tuple[str, ...]:
        """NVRTC options of the spmv.cu build this shape runs."""
        return (
            (("-DMLEM_STREAM",) if self.stream else ())
            + ((f"-DMLEM_BLOCK_MINB={self.min_blocks}",) if self.min_blocks > 1 else ())
            + ((f"-DMLEM_VEC_UNROLL={self.unroll}",) if self.unroll != VEC_UNROLL else ())
            + ((f"-DMLEM_ROW_BOUND={self.row_bound}",) if self.row_bound else ())
        )

    def label(self) -> str:
        """``1024t sync w0 stream mb2`` style text for tables; ``1024t row1024 stream mb2 u1`` for ``csr_row_L``."""
        return (
            f"{self.threads}t"
            + (" sync" if self.sync and not self.row_bound else "")
            + ("" if self.waves is None or self.row_bound else f" w{self.waves}")
            + (f" row{self.row_bound}" if self.row_bound else "")
            + (" stream" if self.stream else "")
            + (f" mb{self.min_blocks}" if self.min_blocks > 1 else "")
            + (f" u{self.unroll}" if self.unroll != VEC_UNROLL else "")
        )


#: The launch shapes ``csr_vector`` is timed under when a backend tunes a matrix
#: (:meth:`mlemlib.backends._cuda_kernels.DeviceCSR.tune`): csr_vector_L's own;
#: block-aligned grids without a grid-stride loop, which keep the rows in flight
#: together; 256 threads with streaming loads of the matrix, with and without the
#: grid-stride loop; csr_row_L at 32 registers (64 warps per multiprocessor) or 40.
#: Which is fastest depends on the matrix, its order and the GPU.
SHAPE_CANDIDATES = (
    RowShape(),
    RowShape(THREADS, False, None, True),
    RowShape(THREADS, False, 0, True),
    RowShape(512, False, 0, True),
    RowShape(1024, False, 0, True),
    RowShape(1024, False, 0, False, 2),
    RowShape(1024, False, 0, True, 2),
    RowShape(THREADS, unroll=2),
    RowShape(512, False, 0, True, unroll=2),
    RowShape(1024, False, 0, True, unroll=2),
    RowShape(1024, False, 0, True, 2, unroll=2),
    RowShape(1024, False, 0, True, 2, unroll=1, row_bound=1024),
    RowShape(512, False, 0, True, 2, unroll=1, row_bound=1024),
    RowShape(256, False, 0, True, 2, unroll=1, row_bound=1024),
    RowShape(768, False, 0, True, 2, unroll=2, row_bound=768),
)

#: Longest row ``csr_row_L`` takes (32-bit offsets within a row; its head is aligned down by up to 3).
ROW_KERNEL_MAX_LENGTH = 2**31 - 4


#: Largest nnz cuSPARSE takes through CuPy (int32 indices).
CUSPARSE_MAX_NNZ = registry.CUSPARSE_MAX_NNZ


def choose_lanes(mean_row_length: float, cap: int = LANE_CHOICES[-1]) -> int:
    """Lanes per row for ``csr_vector`` / ``scatter``: ``2..cap``, a power of two.

    One trip of a group of ``L`` lanes covers ``4 L`` non-zeros (16-byte
    loads), so ``L`` is the power of two at or above ``mean / 4``, clamped to
    ``[2, cap]``: short rows do not leave most of a warp idle, long rows get a
    whole warp (or ``cap`` lanes).

    Parameters
    ----------
    mean_row_length
        Non-zeros per row, on average (nnz / m).
    cap
        Most lanes per row, one of :data:`LANE_CHOICES` (32: a warp).

    Returns
    -------
    int
        One of :data:`LANE_CHOICES`.
    """
    if cap not in LANE_CHOICES:
        raise ValueError(f"cap must be one of {LANE_CHOICES}, got {cap}")
    if not math.isfinite(mean_row_length) or mean_row_length <= 0:
        return LANE_CHOICES[0]
    want = mean_row_length / VECTOR_WIDTH
    lanes = 1 << max(0, math.ceil(math.log2(want))) if want > 1 else 1
    return int(min(max(lanes, LANE_CHOICES[0]), cap))


def launch_shape(
    items: int,
    items_per_block: int,
    sm_count: int,
    max_threads_per_sm: int,
    threads: int = THREADS,
    waves: int | None = None,
) -> tuple[int, int]:
    """Blocks and threads of a grid-stride launch.

    Parameters
    ----------
    items
        Work items (rows, row groups, merge sections).
    items_per_block
        Items one block takes per trip (threads / lanes for the row kernels).
    sm_count, max_threads_per_sm
        Device properties (``multiProcessorCount``, ``maxThreadsPerMultiProcessor``).
    threads
        Threads per block.
    waves
        Cap in full waves of the device (default :data:`WAVES`); 0: no cap
        (one item per block slot, the hardware schedules the blocks).

    Returns
    -------
    (blocks, threads)
        ``blocks`` is enough for one item per block slot, capped at
        ``waves`` full waves of the device (the kernels loop over the
        rest), and at least 1.
    """
    if items_per_block <= 0 or threads <= 0:
        raise ValueError("items_per_block and threads must be positive")
    waves = WAVES if waves is None else int(waves)
    if waves < 0:
        raise ValueError(f"waves must be >= 0, got {waves}")
    needed = -(-max(int(items), 0) // items_per_block)
    if waves == 0:
        return max(1, needed), threads
    cap = max(1, sm_count * max(1, max_threads_per_sm // threads) * waves)
    return max(1, min(needed, cap)), threads


def spmv_bytes(rows: int, cols: int, nnz: int, rowptr_itemsize: int = 8) -> int:
    """Fewest bytes ``y = M x`` moves for a CSR ``M`` of shape ``(rows, cols)``.

    The matrix once (8 bytes per non-zero and the row pointer), ``x`` read
    once (4 bytes per column) and ``y`` written once (4 bytes per row). The
    same count holds for ``A^T c`` scattered from the rows of ``A`` (rows =
    m, cols = n), where the vectors swap roles.
    """
    return BYTES_PER_NNZ * nnz + rowptr_itemsize * (rows + 1) + 4 * cols + 4 * rows


def csr_bytes(rows: int, nnz: int, rowptr_itemsize: int = 8) -> int:
    """Bytes of a CSR matrix's arrays (row pointer, columns, values)."""
    return BYTES_PER_NNZ * nnz + rowptr_itemsize * (rows + 1)


#: The launch order of the atomic scatter: its rows spread over the matrix (:func:`spread_stride`).
GOLDEN = (1 + 5**0.5) / 2


def spread_stride(m: int) -> int:
    """The stride ``P`` of the scatter's launch order: lane group ``w`` takes row ``w P mod m``.

    ``P`` is the first integer from ``m / golden ratio`` up that is coprime with ``m``, so that
    ``w -> w P mod m`` visits every row once and the rows in flight together (consecutive ``w``)
    lie all over the matrix instead of being a fan of neighbouring LORs whose atomics meet on the
    same voxels. 1 (rows in
    order) below 3 rows and from ``2**32`` rows, where ``w P`` could overflow 64 bits.
    """
    if m < 3 or m >= 1 << 32:
        return 1
    p = int(m / GOLDEN)
    while math.gcd(p, m) != 1:
        p += 1
    return p


def iteration_floor_bytes(m: int, n: int, nnz: int, *, transpose: bool = True) -> int:
    """Bytes one MLEM iteration must read at least: ``A`` and ``A^T`` (or ``A`` twice).

    The vectors are left out, as in the thesis and PERFORMANCE.md (they are
    under 1% of a PET matrix).
    """
    return csr_bytes(m, nnz) + (csr_bytes(n, nnz) if transpose else csr_bytes(m, nnz))


def merge_threads(m: int, nnz: int, secsize: int) -> int:
    """Threads the merge-based kernel needs: one per ``secsize`` merge items (m + nnz)."""
    if secsize < 1:
        raise ConfigError("secsize", f"section size must be >= 1, got {secsize}")
    return -(-(m + nnz) // secsize)


def chunk_rows(indptr: np.ndarray, nnz_per_chunk: int) -> np.ndarray:
    """Row boundaries of nnz-balanced chunks: ``r[0] = 0 < r[1] < ... < r[-1] = m``.

    Chunk ``b`` is rows ``[r[b], r[b+1])``; it holds about ``nnz_per_chunk``
    non-zeros (a row is never split, so a chunk can hold more when one row is
    longer). Every chunk holds at least one row.
    """
    indptr = np.asarray(indptr, dtype=np.int64)
    m = len(indptr) - 1
    if m <= 0:
        return np.zeros(1, dtype=np.int64)
    nnz = int(indptr[-1] - indptr[0])
    nchunks = max(1, -(-nnz // max(1, int(nnz_per_chunk))))
    targets = indptr[0] + np.arange(1, nchunks, dtype=np.int64) * max(1, int(nnz_per_chunk))
    cuts = np.searchsorted(indptr, targets, side="left")
    bounds = np.unique(np.concatenate(([0], np.clip(cuts, 1, m), [m])))
    return bounds.astype(np.int64)


def interleave_positions(indptr: np.ndarray, lanes: int) -> np.ndarray:
    """Slot of each element in the interleaved layout for ``lanes`` lanes per row (NumPy reference).

    The layout of ``DeviceCSR.set_layout(lanes)`` (kernel ``csr_interleave``):
    a row ``[s, e)``'s 16-byte part, quads ``ceil(s / 4)`` to ``floor(e / 4)``
    (what ``csr_vector`` loads as int4/float4), falls into trips of ``lanes``
    quads, the last of ``Q <= lanes``; element ``j = k Q + l`` of a trip (in
    column order) goes to slot ``4 l + k`` of the trip, so that lane ``l``
    loads the elements ``l, Q + l, 2 Q + l, 3 Q + l`` and each of its four
    gathers covers ``Q`` consecutive elements. The head ``[s, 4 ceil(s / 4))``
    and the tail ``[4 floor(e / 4), e)`` keep their slots.

    Returns ``pos`` (int64, one per element from ``indptr[0]``): the element at
    ``p`` in column order is stored at ``pos[p - indptr[0]]``.
    """
    indptr = np.asarray(indptr, dtype=np.int64)
    if lanes not in LANE_CHOICES:
        raise ConfigError("lanes", f"lanes per row must be one of {LANE_CHOICES}, got {lanes}")
    base = int(indptr[0]) if len(indptr) else 0
    nnz = int(indptr[-1]) - base if len(indptr) else 0
    p = np.arange(base, base + nnz, dtype=np.int64)
    row = np.searchsorted(indptr, p, side="right") - 1
    qa, qe = (indptr[row] + 3) >> 2, indptr[row + 1] >> 2
    inside = (p >= 4 * qa) & (p < 4 * qe)
    rel = p - 4 * qa
    trip = rel // (4 * lanes)
    q = np.minimum(qe - qa - trip * lanes, lanes)
    j = rel - trip * 4 * lanes
    q = np.maximum(q, 1)  # outside the quads q may be 0; those elements keep their slot
    moved = 4 * qa + trip * 4 * lanes + 4 * (j % q) + j // q
    return np.where(inside, moved, p)


def row_layouts(fp_interleaved: bool, bp_interleaved: bool, transpose: bool, lanes_fp: int, lanes_bp: int) -> tuple[int, int]:
    """Layouts (``DeviceCSR.set_layout``) of ``A`` and ``A^T`` for a backend's kernels: 0 or the lanes.

    ``fp_interleaved`` / ``bp_interleaved``: the forward / back kernel reads its rows lane-interleaved
    (the registry's :attr:`~mlemlib.registry.Kernel.interleaved`: ``csr_vector``). A matrix is
    interleaved only where such a kernel is its one reader: ``A`` when the back projection runs on
    a stored ``A^T`` (the scatter kernels and the one pass read ``A`` one element per lane, whose
    atomics want the columns in order); ``A^T`` when the back projection reads it so. cuSPARSE sets
    its matrix back to column order itself. Only for 8 lanes or more (:data:`BLOCK_LANES`): fewer
    lanes take rows of a few elements, whose gathers the layout cannot bring closer.
    """
    la = lanes_fp if fp_interleaved and transpose and lanes_fp in BLOCK_LANES else 0
    lt = lanes_bp if bp_interleaved and transpose and lanes_bp in BLOCK_LANES else 0
    return la, lt
