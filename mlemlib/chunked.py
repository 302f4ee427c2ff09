"""Row chunks with their own voxel lists: the plan of a one pass that scatters into shared memory.

The one-pass and scatter kernels are bound by their global atomics: one per
non-zero, served by the L2 cache. After the
reorder stage, consecutive rows (LORs with close entry and exit points)
touch nearly the same voxels: a chunk of rows whose distinct voxels fit
16,384 float32 reuses each of them many times (``mlem info`` shows it). A
kernel that takes one chunk per thread block, stages ``f`` at the chunk's
voxels in shared memory, accumulates the chunk's back projection there, and
adds each distinct voxel to global memory once makes ``1 / reuse`` of the
global atomics. The chunk's voxels are scattered over the volume's index
range (a compact region lies on several stretches of the Hilbert curve), so
each chunk carries its sorted list of distinct voxels and every non-zero a
16-bit index into that list, not a column.

Provides

- :func:`greedy_chunks` — the chunk boundaries (compiled; also behind
  :func:`mlemlib.reorder.voxel_reuse`);
- :class:`ChunkPlan` and :func:`build_plan` — the chunks of a CSR matrix in
  its stored row order, their voxel lists and the local index of every
  non-zero (built on all cores, one chunk per task);
- :func:`onepass` — the one-pass MLEM step computed through the plan on the
  CPU (Numba, float32, chunks in order): the reference a GPU kernel of the
  plan is checked against;
- :func:`onepass_fixed` — the GPU kernel's own arithmetic on the CPU (the
  same bits);
- :func:`interleave` — the rows' layout on the GPU (padded to 4 elements,
  groups of 128 interleaved for vector loads);
- :func:`sample_chunks` — reuse and chunk count estimated from one block:
  what ``auto`` decides from;
- :func:`layout_blocks` — the kernel's layout of a matrix, block by block
  (plan, 16-bit values, interleaving): the one code that the upload and the
  file use;
- :func:`write_layout`, :func:`open_layout` (:class:`ChunkLayout`) — that
  layout as a file (``mlem chunk``, the workflow's ``chunk_matrix``), checked
  against the matrix it was made from; :func:`chunk_ranges` — its chunks
  split nnz-balanced over GPUs.

The GPU kernel of this plan is ``chunked_onepass`` (``kernels/compressed.cu``;
:class:`mlemlib.backends._compressed_cuda.DeviceChunked` builds the plan
block by block while uploading, or loads a layout file; the registry's
``onepass_chunked``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from mlemlib.errors import MatrixFormatError
from mlemlib.matrix import CSRMatrix
from mlemlib.setup_times import phase

log = logging.getLogger(__name__)

#: Largest chunk window: local indices are 16-bit.
MAX_WINDOW = 1 << 16
#: Default voxels per chunk: 16,384 float32 of ``f`` and 16,384 partial sums (64-bit for the
#: deterministic kernel) take 192 KB of a Hopper multiprocessor's 227 KB of shared memory.
DEFAULT_WINDOW = 1 << 14


#: Chunks per multiprocessor that a GPU's share should make at least (:func:`chunk_cap_for`): each chunk is one
#: thread block that fills a multiprocessor, so a small share (an OSEM subset's, on one GPU or several) is cut
#: into smaller chunks rather than leave multiprocessors idle.
CHUNK_WAVES = 1
#: Fewest non-zeros per chunk that :func:`chunk_cap_for` goes down to.
MIN_CHUNK_NNZ = 1 << 13


def chunk_cap_for(nnz: int, sms: int) -> int:
    """Most non-zeros per chunk for a GPU's share of ``nnz`` non-zeros on ``sms`` multiprocessors:
    :data:`MAX_CHUNK_NNZ`, less where that share would make fewer than :data:`CHUNK_WAVES` chunks per
    multiprocessor, not below :data:`MIN_CHUNK_NNZ`."""
    want = int(nnz) // max(1, CHUNK_WAVES * int(sms))
    return int(min(MAX_CHUNK_NNZ, max(MIN_CHUNK_NNZ, want)))


#: Multiprocessor waves of a launch's smallest chunks that :func:`launch_order` puts at its end.
TAIL_WAVES = 1


def launch_order(sizes: np.ndarray, sms: int, tail_waves: int | None = None) -> np.ndarray:
    """The order a GPU starts its chunks in (int32 chunk numbers; the kernel's block ``b`` takes chunk
    ``order[b]``): row order, except that the ``tail_waves * sms`` smallest chunks by ``sizes`` (their stored
    elements) go last, largest first.

    Blocks start in index order as multiprocessors free up, so a launch ends when its last chunks do; row
    order keeps neighbouring chunks, which share voxels, close in time (the L2 cache serves their staging
    and flushes). ``tail_waves`` defaults to :data:`TAIL_WAVES`; 0 gives row order. The sums are integers,
    the same bits in any order.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    waves = TAIL_WAVES if tail_waves is None else int(tail_waves)
    k = min(len(sizes), max(0, waves) * max(1, int(sms)))
    if k == 0:
        return np.arange(len(sizes), dtype=np.int32)
    by_size = np.argsort(sizes, kind="stable")  # smallest first; ties in row order
    tail = by_size[:k][::-1]
    keep = np.ones(len(sizes), dtype=bool)
    keep[tail] = False
    return np.concatenate([np.flatnonzero(keep), tail]).astype(np.int32)


#: Non-zeros of the block :func:`sample_chunks` reads.
SAMPLE_NNZ = 1 << 24
#: Most rows per chunk: the fixed-point kernel's low words (20-bit parts summed in 32 bits)
#: take at most 4,096 terms per voxel and chunk, and a voxel gets one term per row.
MAX_CHUNK_ROWS = 1 << 12
#: Most non-zeros per chunk: a chunk is one thread block (one per multiprocessor: its window fills the
#: shared memory), whose time grows with its non-zeros, so the largest chunk bounds how late a GPU's
#: last block ends. 2^18 is about twice a reordered madpet2's mean chunk (whose largest held 13 times the
#: mean), and costs it 3% of its voxel reuse.
MAX_CHUNK_NNZ = 1 << 18


def window_of(window: int) -> int:
    """A chunk's window (its most distinct voxels) as an int, checked.

    Raises
    ------
    ValueError
        Outside ``[1, 65536]`` (local indices are 16-bit).
    """
    window = int(window)
    if not 1 <= window <= MAX_WINDOW:
        raise ValueError(f"window must lie in [1, {MAX_WINDOW}] (16-bit local indices), got {window}")
    return window


def chunk_cap_of(chunk_cap: int | None) -> int:
    """A chunk's most non-zeros as given (None: :data:`MAX_CHUNK_NNZ`), checked.

    Raises
    ------
    ValueError
        Below 1.
    """
    cap = MAX_CHUNK_NNZ if chunk_cap is None else int(chunk_cap)
    if cap < 1:
        raise ValueError(f"chunk_cap must be at least 1 non-zero, got {chunk_cap}")
    return cap


@njit(cache=True)
def greedy_chunks(indptr, indices, rows, n, window, max_rows=1 << 62, max_nnz=1 << 62):  # pragma: no cover - compiled
    """Group ``rows`` (taken in that order) greedily into chunks of at most ``window`` distinct columns.

    A chunk also takes at most ``max_rows`` rows and ``max_nnz`` non-zeros. A
    row with more distinct columns than ``window`` or more non-zeros than
    ``max_nnz`` is a chunk of its own.
    Returns ``(starts, distinct)``: chunk ``c`` holds ``rows[starts[c]:starts[c + 1]]``
    (``starts`` has one entry more than there are chunks) and touches
    ``distinct[c]`` columns.
    """
    stamp = np.full(n, -1, np.int64)
    starts = np.empty(rows.shape[0] + 1, np.int64)
    distinct = np.empty(rows.shape[0], np.int64)
    chunk = 0
    count = 0
    taken = 0
    nz = 0
    starts[0] = 0
    for t in range(rows.shape[0]):
        r = rows[t]
        a, b = indptr[r], indptr[r + 1]
        new = 0
        for k in range(a, b):
            if stamp[indices[k]] != chunk:
                new += 1
        if taken > 0 and (count + new > window or taken >= max_rows or nz + (b - a) > max_nnz):
            distinct[chunk] = count
            chunk += 1
            starts[chunk] = t
            count = 0
            taken = 0
            nz = 0
            new = b - a  # the columns of a row are distinct
        for k in range(a, b):
            stamp[indices[k]] = chunk
        count += new
        taken += 1
        nz += b - a
    if taken > 0:
        distinct[chunk] = count
        chunk += 1
        starts[chunk] = rows.shape[0]
    return starts[: chunk + 1].copy(), distinct[:chunk].copy()


@njit(parallel=True, cache=True)
def _fill(indptr, indices, chunk_rows, vptr, voxels, local, n, groups):  # pragma: no cover - compiled
    # Chunks in `groups` contiguous runs, one task each with its own voxel stamps and positions
    # (2 arrays of n entries per task, not per chunk): a chunk's distinct voxels are found in one
    # pass, sorted (only the distinct ones), and every non-zero's position read back in O(1).
    nch = chunk_rows.shape[0] - 1
    for gi in prange(groups):
        stamp = np.full(n, -1, np.int64)
        pos = np.zeros(n, np.int32)
        for c in range(nch * gi // groups, nch * (gi + 1) // groups):
            a = indptr[chunk_rows[c]]
            b = indptr[chunk_rows[c + 1]]
            v0 = vptr[c]
            cnt = 0
            for k in range(a, b):
                j = indices[k]
                if stamp[j] != c:
                    stamp[j] = c
                    voxels[v0 + cnt] = j
                    cnt += 1
            voxels[v0 : v0 + cnt] = np.sort(voxels[v0 : v0 + cnt])
            for i in range(cnt):
                pos[voxels[v0 + i]] = i
            for k in range(a, b):
                local[k] = pos[indices[k]]


@dataclass
class ChunkPlan:
    """Chunks of consecutive rows of a CSR matrix, each with its own sorted voxel list.

    Chunk ``c`` holds rows ``[chunk_rows[c], chunk_rows[c + 1])`` and voxels
    ``voxels[vptr[c]:vptr[c + 1]]`` (sorted, distinct, at most ``window``);
    non-zero ``k`` of those rows is at column ``voxels[vptr[c] + local[k]]``.
    The matrix's row pointer and values are used as they are (not copied).
    """

    shape: tuple[int, int]
    window: int
    chunk_rows: np.ndarray  # int64, chunks + 1
    vptr: np.ndarray  # int64, chunks + 1
    voxels: np.ndarray  # int32
    local: np.ndarray  # uint16, one per non-zero

    @property
    def chunks(self) -> int:
        return len(self.chunk_rows) - 1

    @property
    def reuse(self) -> float:
        """Non-zeros per global atomic of the chunked scatter (non-zeros / voxel-list entries)."""
        return len(self.local) / len(self.voxels) if len(self.voxels) else 1.0

    def bytes_per_nnz(self, value_bytes: int = 4) -> float:
        """Bytes a kernel reads per non-zero: local index, value, the voxel lists and both pointers."""
        nnz = len(self.local)
        if nnz == 0:
            return 0.0
        extra = self.voxels.nbytes + self.vptr.nbytes + self.chunk_rows.nbytes + 8 * (self.shape[0] + 1)
        return 2 + value_bytes + extra / nnz

    def columns(self, indptr: np.ndarray) -> np.ndarray:
        """The column of every non-zero, rebuilt from the plan (a check: equals the matrix's indices)."""
        ip = np.asarray(indptr, dtype=np.int64)
        per_nnz = np.repeat(np.arange(self.chunks), np.diff(ip[self.chunk_rows]))
        return self.voxels[self.vptr[per_nnz] + self.local.astype(np.int64)]


def build_plan(a: CSRMatrix, window: int = DEFAULT_WINDOW, chunk_cap: int | None = None) -> ChunkPlan:
    """The :class:`ChunkPlan` of ``a`` in its stored row order (reorder the matrix first).

    A chunk holds at most ``window`` distinct voxels, :data:`MAX_CHUNK_ROWS`
    rows and ``chunk_cap`` non-zeros (None: :data:`MAX_CHUNK_NNZ`; a longer row is a chunk of its own).

    Raises
    ------
    ValueError
        ``window`` outside ``[1, 65536]`` (local indices are 16-bit), a
        ``chunk_cap`` below 1, or a row with more than ``window`` non-zeros (it could not be scattered
        through one chunk's shared memory).
    """
    window = window_of(window)
    cap = chunk_cap_of(chunk_cap)
    m, n = a.shape
    ip = np.asarray(a.indptr, dtype=np.int64)
    idx = np.asarray(a.indices)
    longest = int(np.diff(ip).max()) if m else 0
    if longest > window:
        raise ValueError(f"a row has {longest} non-zeros, more than the window of {window} voxels")
    starts, distinct = greedy_chunks(ip, idx, np.arange(m, dtype=np.int64), n, window, MAX_CHUNK_ROWS, cap)
    vptr = np.zeros(len(distinct) + 1, dtype=np.int64)
    np.cumsum(distinct, out=vptr[1:])
    voxels = np.empty(int(vptr[-1]), dtype=np.int32)
    local = np.empty(len(idx), dtype=np.uint16)
    if len(distinct):
        import numba

        _fill(ip, idx, starts, vptr, voxels, local, n, min(len(distinct), 2 * numba.get_num_threads()))
    return ChunkPlan((m, n), window, starts, vptr, voxels, local)


# --------------------------------------------------------------------------- the rows' layout on the GPU
#: Lanes of the kernel's warp, elements a lane reads with one vector load, and their product: the
#: interleaved group of :func:`interleave`.
LANES = 32
VEC = 4
GROUP = LANES * VEC


def padded_indptr(indptr: np.ndarray) -> np.ndarray:
    """Row pointer (from 0) of the stored layout: every row's length rounded up to a multiple of :data:`VEC`."""
    ip = np.asarray(indptr, dtype=np.int64)
    out = np.zeros(len(ip), dtype=np.int64)
    if len(ip) > 1:
        np.cumsum((np.diff(ip) + (VEC - 1)) // VEC * VEC, out=out[1:])
    return out


def stored_positions(indptr: np.ndarray) -> np.ndarray:
    """Where :func:`interleave` puts each non-zero (NumPy; the reference its compiled loop is tested against).

    Row ``r``'s element ``o`` (0-based within the row) of a padded length
    ``P`` goes to ``pindptr[r] + 128 g + 4 l + t`` when ``o = 128 g + 32 t + l``
    lies in one of the row's ``P // 128`` whole groups, else to
    ``pindptr[r] + o``.
    """
    ip = np.asarray(indptr, dtype=np.int64)
    pip = padded_indptr(ip)
    lengths = np.diff(ip)
    row = np.repeat(np.arange(len(lengths)), lengths)
    o = np.arange(int(ip[-1] - ip[0]) if len(ip) else 0, dtype=np.int64) - (ip[row] - ip[0])
    whole = (np.diff(pip) // GROUP * GROUP)[row]
    g, w = o // GROUP, o % GROUP
    inter = g * GROUP + (w % LANES) * VEC + w // LANES
    return pip[row] + np.where(o < whole, inter, o)


def half_rows(block: CSRMatrix, fmt: str = "compressed-f16", *, scale: np.ndarray | None = None,
              what: str = "matrix", row0: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """16-bit values and row scales that give ``block``'s float32 values back exactly.

    For the decoded rows of a ``compressed-f16`` matrix (values that are
    float16 times a power of two per row): ``(scale float32[rows], values
    float16[nnz])`` with ``float32(values[k]) * scale[row] == data[k]``, the
    scale chosen by the encoder's rule (:mod:`mlemlib.compressed`) from the
    decoded values: the encoder's own scale, or twice it where a row's
    largest value had rounded up to 2^15 times it. For a ``compressed-u16``
    matrix's rows, given its row scales ``scale``: ``(scale, values
    uint16[nnz])`` with ``values = rint(data / scale[row])`` and
    ``float32(float32(values[k]) * scale[row]) == data[k]``.

    Raises
    ------
    ValueError
        A row whose values are not such 16-bit values times its row scale,
        naming ``what`` and the row (``row0`` + its index in the block); a
        ``compressed-u16`` block without its row scales.
    """
    from mlemlib._compressed_kernels import _row_scales
    from mlemlib.compressed import VALUE_DTYPES
    from mlemlib.formats.spec import matrix_format_of

    ip = np.asarray(block.indptr, dtype=np.int64)
    data = np.asarray(block.data, dtype=np.float32)
    rows = len(ip) - 1
    lengths = np.diff(ip)
    if matrix_format_of(fmt).integer_codes:
        if scale is None or len(scale) != rows:
            raise ValueError(f"{what}: compressed-u16 rows need their {rows} row scales")
        scale = np.asarray(scale, dtype=np.float32)
        q = np.rint(data / np.repeat(scale.astype(np.float64), lengths))
        values = np.clip(q, 0, 65535).astype(np.uint16)
        ok = q <= 65535
    else:
        scale = np.empty(rows, dtype=np.float32)
        scaled = np.empty(len(data), dtype=np.float64)
        if rows:
            _row_scales(ip, data, scale, scaled, False)
        values = scaled.astype(VALUE_DTYPES[fmt])
        ok = np.ones(len(data), dtype=bool)
    back = values.astype(np.float32) * np.repeat(scale, lengths)
    bad = np.flatnonzero((back != data) | ~ok)
    if len(bad):
        row = int(np.searchsorted(ip, bad[0] + ip[0], side="right") - 1)
        raise ValueError(f"{what}: row {row0 + row} has values that are not {values.dtype} times its row scale "
                         f"(not a {fmt} matrix's)")
    return scale, values


@njit(parallel=True, cache=True)
def _interleave(ip, pip, local, data, local_out, data_out):  # pragma: no cover - compiled
    for r in prange(ip.shape[0] - 1):
        s = ip[r] - ip[0]
        n = ip[r + 1] - ip[r]
        d = pip[r]
        padded = pip[r + 1] - d
        whole = padded // 128 * 128
        for o in range(padded):
            p = d + o
            if o < whole:
                w = o % 128
                p = d + (o - w) + (w % 32) * 4 + w // 32
            if o < n:
                local_out[p] = local[s + o]
                data_out[p] = data[s + o]
            else:
                local_out[p] = 0
                data_out[p] = 0.0


def interleave(indptr: np.ndarray, local: np.ndarray, data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A block of rows in the layout the GPU's ``chunked_onepass`` reads: ``(pindptr, local, data)``.

    Every row is padded with zeros (value 0, local index 0: terms that add
    nothing) to a multiple of :data:`VEC` elements, so that it starts on an
    8-byte (indices) and 16-byte (values) boundary; in each whole group of
    :data:`GROUP` elements, element ``32 t + l`` is stored at ``4 l + t``, so
    that lane ``l`` reads its trips ``t = 0..3`` with one vector load
    (:func:`stored_positions`). The rest of a row stays in order. The
    kernel's lanes see the same elements in the same order as without the
    layout: the sums do not change. ``pindptr`` starts at 0. ``data`` is
    float32, or float16 or uint16 (kept as they are).
    """
    ip = np.asarray(indptr, dtype=np.int64)
    pip = padded_indptr(ip)
    total = int(pip[-1])
    data = np.asarray(data)
    half = data.dtype in (np.float16, np.uint16)
    bits = data.view(np.uint16) if half else np.asarray(data, dtype=np.float32)  # Numba moves float16 as bits
    local_out = np.empty(total, dtype=np.uint16)
    data_out = np.empty(total, dtype=bits.dtype)
    if len(ip) > 1:
        _interleave(ip, pip, np.asarray(local, dtype=np.uint16), bits, local_out, data_out)
    return pip, local_out, data_out.view(data.dtype) if half else data_out


@njit(cache=True)
def _onepass(indptr, data, chunk_rows, vptr, voxels, local, g, f, fp, bp):  # pragma: no cover - compiled
    fl = np.zeros(MAX_WINDOW, np.float32)
    acc = np.zeros(MAX_WINDOW, np.float32)
    for c in range(chunk_rows.shape[0] - 1):
        v0 = vptr[c]
        nv = vptr[c + 1] - v0
        for i in range(nv):
            fl[i] = f[voxels[v0 + i]]
            acc[i] = 0.0
        for r in range(chunk_rows[c], chunk_rows[c + 1]):
            s = np.float32(0.0)
            for k in range(indptr[r], indptr[r + 1]):
                s += data[k] * fl[local[k]]
            fp[r] = s
            if s != 0.0:
                ci = np.float32(g[r] / s)
                for k in range(indptr[r], indptr[r + 1]):
                    acc[local[k]] += data[k] * ci
        for i in range(nv):
            bp[voxels[v0 + i]] += acc[i]


def onepass(plan: ChunkPlan, indptr: np.ndarray, data: np.ndarray, g: np.ndarray, f: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray]:
    """One-pass MLEM step through the plan: ``fp = A f``, ``c = g / fp`` (0 where fp is 0), ``bp = A^T c``.

    float32 throughout; each chunk's rows in order, accumulated in the
    chunk's list, then added to ``bp`` chunk after chunk (deterministic).
    Returns ``(bp, fp)``.
    """
    m, n = plan.shape
    g = np.ascontiguousarray(g, dtype=np.float32)
    f = np.ascontiguousarray(f, dtype=np.float32)
    if g.shape != (m,) or f.shape != (n,):
        raise ValueError(f"g must have {m} entries and f {n}, got {g.shape} and {f.shape}")
    fp = np.zeros(m, dtype=np.float32)
    bp = np.zeros(n, dtype=np.float32)
    _onepass(np.asarray(indptr, dtype=np.int64), np.asarray(data, dtype=np.float32), plan.chunk_rows,
             plan.vptr, plan.voxels, plan.local, g, f, fp, bp)
    return bp, fp


class _CompressedRows:
    """Row blocks of an in-memory :class:`~mlemlib.compressed.CompressedMatrix`, decoded to CSR one block at a time."""

    def __init__(self, cm) -> None:
        self.cm, self.shape, self.nnz, self.format = cm, cm.shape, cm.nnz, cm.format
        self._sp = cm.slotptr()
        self._ip = cm.csr_indptr()

    def chunk_bounds(self, max_nnz: int) -> list[tuple[int, int]]:
        from mlemlib.matrix import chunk_bounds

        return chunk_bounds(self._ip, max_nnz)

    def read_rows(self, r0: int, r1: int) -> CSRMatrix:
        return self.cm.decode_rows(r0, r1, slotptr=self._sp)

    def read_scale(self, r0: int, r1: int) -> np.ndarray | None:
        return None if self.cm.scale is None else self.cm.scale[r0:r1]


def _host_source(source):
    """``source`` as something :func:`_host_bounds` and :func:`_host_rows` read (SciPy matrices become CSR)."""
    if hasattr(source, "read_rows") or isinstance(source, CSRMatrix) or hasattr(getattr(source, "indptr", None), "get"):
        return source  # an opened matrix file (CSR or compressed, read as CSR), a host CSR, a device CSR
    if hasattr(source, "slotptr") and hasattr(source, "codes"):
        if hasattr(source.codes, "get"):
            raise TypeError("a compressed matrix already on the GPU cannot be re-chunked; pass the host matrix or file")
        return _CompressedRows(source)  # an in-memory compressed matrix
    if hasattr(source, "tocsr"):
        return CSRMatrix.from_scipy(source)
    raise TypeError(f"cannot read rows of {type(source).__name__}")


def _host_indptr(source) -> np.ndarray:
    """The whole row pointer of a source of :func:`_host_source` (host int64)."""
    if hasattr(source, "read_indptr"):  # an opened matrix file
        return np.asarray(source.read_indptr(), dtype=np.int64)
    if isinstance(source, _CompressedRows):
        return np.asarray(source._ip, dtype=np.int64)
    ip = source.indptr
    return np.asarray(ip.get() if hasattr(ip, "get") else ip, dtype=np.int64)  # a host or device CSR


def _host_bounds(source, max_nnz: int, rows: tuple[int, int] | None = None) -> list[tuple[int, int]]:
    from mlemlib.matrix import chunk_bounds

    if rows is None:
        if hasattr(source, "read_rows"):  # an opened matrix file
            return source.chunk_bounds(max_nnz)
        if isinstance(source, _CompressedRows):
            return source.chunk_bounds(max_nnz)
        return chunk_bounds(_host_indptr(source), max_nnz)
    r0, r1 = (int(v) for v in rows)
    ip = _host_indptr(source)[r0 : r1 + 1]
    return [(r0 + a, r0 + b) for a, b in chunk_bounds(ip - ip[0], max_nnz)]


def _host_rows(source, r0: int, r1: int) -> CSRMatrix:
    """Rows ``[r0, r1)`` of a CSR source (opened file, host or device CSR) in host memory, row pointer from 0."""
    from mlemlib.matrix import slice_rows

    if hasattr(source, "read_rows"):
        return source.read_rows(r0, r1)
    if isinstance(source, CSRMatrix):
        return slice_rows(source, r0, r1)
    ipr = np.asarray(source.indptr[r0 : r1 + 1].get(), dtype=np.int64)  # a device CSR: positions in its arrays
    a, b = int(ipr[0]), int(ipr[-1])
    return CSRMatrix(ipr - a, source.indices[a:b].get(), source.data[a:b].get(), (r1 - r0, int(source.shape[1])))


def row_blocks(source, max_nnz: int, *, scales: bool = False, rows: tuple[int, int] | None = None):
    """``(r0, r1, block)`` of a CSR source in row order, blocks of about ``max_nnz`` non-zeros in host memory.

    ``rows``: only rows ``[r0, r1)`` (a GPU's row block), else all.

    ``scales``: ``(r0, r1, block, scale)``, ``scale`` the rows' scales of a
    compressed source with 16-bit values (``read_scale``), else None.

    ``source``: an opened matrix file (only each block is read, validated;
    a compressed container's rows decoded), a :class:`CSRMatrix` (views), an
    in-memory compressed matrix (each block decoded), a device CSR (each
    block copied to the host) or a SciPy sparse matrix. One block is in host
    memory at a time.
    """
    source = _host_source(source)
    for r0, r1 in _host_bounds(source, max_nnz, rows):
        if scales:
            read = getattr(source, "read_scale", None)
            yield r0, r1, _host_rows(source, r0, r1), (read(r0, r1) if read is not None else None)
        else:
            yield r0, r1, _host_rows(source, r0, r1)


def sample_chunks(source, window: int = DEFAULT_WINDOW, max_nnz: int = SAMPLE_NNZ) -> tuple[float, float] | None:
    """``(reuse, chunks)`` of the row chunks of one block of about ``max_nnz`` non-zeros from the middle of ``source``.

    What ``auto`` decides ``onepass_chunked`` from
    (:func:`mlemlib.registry.choose_auto`) without chunking the whole
    matrix: the block's rows, in their stored order, grouped as
    :func:`build_plan` would (``window`` voxels, at most
    :data:`MAX_CHUNK_ROWS` rows per chunk); ``reuse`` is the block's
    non-zeros per voxel-list entry, ``chunks`` the whole matrix's chunks
    estimated from the block's (its chunks times the matrix's non-zeros over
    the block's). ``source``: a :class:`CSRMatrix`, an opened matrix file or a
    device CSR. None for a matrix without non-zeros.
    """
    source = _host_source(source)
    bounds = _host_bounds(source, max_nnz)
    if not bounds:
        return None
    r0, r1 = bounds[len(bounds) // 2]
    block = _host_rows(source, r0, r1)
    if block.nnz == 0:
        return None
    ip = np.asarray(block.indptr, dtype=np.int64)
    _, distinct = greedy_chunks(ip, np.asarray(block.indices), np.arange(r1 - r0, dtype=np.int64),
                                int(block.shape[1]), int(window), MAX_CHUNK_ROWS, MAX_CHUNK_NNZ)
    from mlemlib.matrix import shape_nnz

    total = shape_nnz(source)[1]
    return block.nnz / float(distinct.sum()), len(distinct) * total / block.nnz


def sample_reuse(source, window: int = DEFAULT_WINDOW, max_nnz: int = SAMPLE_NNZ) -> float | None:
    """The ``reuse`` of :func:`sample_chunks` (None for a matrix without non-zeros)."""
    got = sample_chunks(source, window, max_nnz)
    return None if got is None else got[0]


# --------------------------------------------------------------------------- the GPU kernel's arithmetic on the CPU
#: Terms of the fixed-point sums stay below 2**52 (the GPU's two 32-bit shared words per voxel).
_QMAX = 4503599627370496.0


@njit(parallel=True, cache=True)
def _onepass_fixed(indptr, data, chunk_rows, vptr, voxels, local, g, f, fp, acc, scale):  # pragma: no cover - compiled
    # acc: (groups, n) uint64, zero; group gi takes a contiguous run of chunks. Returns 1 on a term
    # outside [0, 2^52). Every float32 operation is computed in float64 and rounded once to float32,
    # which gives the correctly rounded float32 result for +, * and / (53 >= 2 * 24 + 2 bits); the
    # fused multiply-add of the GPU's dot product is a * b exactly (48 bits) plus the sum, rounded to
    # float64 and then to float32 (the same as one rounding unless the float64 sum falls on a float32
    # tie it was not on: about one operation in 2^28).
    groups = acc.shape[0]
    nch = chunk_rows.shape[0] - 1
    bad = np.zeros(groups, np.int64)
    for gi in prange(groups):
        fl = np.zeros(MAX_WINDOW, np.float32)
        lane = np.zeros(32, np.float32)
        nxt = np.zeros(32, np.float32)
        for c in range(nch * gi // groups, nch * (gi + 1) // groups):
            v0 = vptr[c]
            for i in range(vptr[c + 1] - v0):
                fl[i] = f[voxels[v0 + i]]
            for r in range(chunk_rows[c], chunk_rows[c + 1]):
                s = indptr[r]
                e = indptr[r + 1]
                lane[:] = 0.0
                for k in range(s, e):  # lane (k - s) % 32 adds its elements in order, fused multiply-adds
                    ln = (k - s) % 32
                    lane[ln] = np.float32(np.float64(data[k]) * np.float64(fl[local[k]]) + np.float64(lane[ln]))
                o = 16
                while o > 0:  # the warp's butterfly: every lane adds its partner's sum
                    for ln in range(32):
                        nxt[ln] = np.float32(np.float64(lane[ln]) + np.float64(lane[ln ^ o]))
                    lane[:] = nxt
                    o //= 2
                sm = lane[0]
                fp[r] = sm
                if sm == 0.0:
                    continue
                ci = np.float32(np.float64(g[r]) / np.float64(sm))
                if ci == 0.0:
                    continue
                for k in range(s, e):
                    q = np.float64(np.float32(np.float64(data[k]) * np.float64(ci))) * scale
                    if not (q >= 0.0 and q < _QMAX):
                        bad[gi] = 1
                    elif q > 0.0:
                        acc[gi, voxels[v0 + local[k]]] += np.uint64(np.rint(q))
    return bad.max() if groups else 0


def onepass_fixed(plan: ChunkPlan, indptr: np.ndarray, data: np.ndarray, g: np.ndarray, f: np.ndarray,
                  scale: float, *, groups: int | None = None) -> tuple[np.ndarray, np.ndarray, bool]:
    """The GPU kernel ``chunked_onepass``'s step on the CPU: ``(bp, fp, overflow)``.

    The same arithmetic as the kernel: each row's dot product summed by 32
    lanes in element order with fused multiply-adds and combined by the warp's
    butterfly, ``c = g / fp`` in float32, each term ``c * a_ij`` rounded to
    ``rint(t * scale)`` (``scale`` from
    :func:`mlemlib.backends._compressed_cuda.chunk_scale`) and summed as
    64-bit integers, ``bp = sum / scale`` rounded to float32. Integer sums do
    not depend on the order, the chunking or ``groups`` (the tasks, default
    the Numba threads): the result is the same bits for any of them.
    ``overflow``: a term outside ``[0, 2^52)`` (redo with a larger scale).
    """
    import numba

    m, n = plan.shape
    g = np.ascontiguousarray(g, dtype=np.float32)
    f = np.ascontiguousarray(f, dtype=np.float32)
    if g.shape != (m,) or f.shape != (n,):
        raise ValueError(f"g must have {m} entries and f {n}, got {g.shape} and {f.shape}")
    groups = max(1, min(plan.chunks, numba.get_num_threads() if groups is None else int(groups)))
    acc = np.zeros((groups, n), dtype=np.uint64)
    fp = np.zeros(m, dtype=np.float32)
    bad = _onepass_fixed(np.asarray(indptr, dtype=np.int64), np.asarray(data, dtype=np.float32), plan.chunk_rows,
                         plan.vptr, plan.voxels, plan.local, g, f, fp, acc, float(scale))
    total = acc.sum(axis=0, dtype=np.uint64)
    bp = (total.astype(np.float64) * (1.0 / float(scale))).astype(np.float32)
    return bp, fp, bool(bad)


# --------------------------------------------------------------------------- the layout, block by block, and its file
#: ``chunked_onepass_u16`` forms ``2^23 s`` of each row scale ``s`` (the exact one-FMA decode): scales below this.
U16_SCALE_MAX = 2.0**100
#: Non-zeros per block the layout is built in (the upload's block, ``_compressed_cuda.UPLOAD_CHUNK_NNZ``).
LAYOUT_BLOCK_NNZ = 1 << 26
#: The ``format`` attribute of a layout file, and its version.
LAYOUT_FORMAT = "mlem-chunks"
LAYOUT_VERSION = 1
#: Elements per HDF5 chunk of a layout file's datasets (no filters: a job reads them at the disk's speed; a
#: Fletcher-32 checksum per chunk reads about 10 times slower, more than chunking the matrix again costs).
_H5_CHUNK = 1 << 20
#: The arrays of a layout file (the 16-bit formats' ``scale`` besides): name -> dtype (``data``: the values').
LAYOUT_ARRAYS = {"indptr": np.int64, "local": np.uint16, "data": None, "chunk_rows": np.int64, "vptr": np.int64,
                 "voxels": np.int32, "nnzptr": np.int64}


@dataclass
class LayoutBlock:
    """One block of rows in the kernel's layout: what :class:`DeviceChunked` copies to a GPU and
    :func:`write_layout` to a file.

    Rows ``[r0, r1)`` of the source; ``indptr`` (from 0), ``local`` and
    ``data`` as :func:`interleave` gives them; ``scale`` the rows' scales of
    16-bit values (else None); the block's chunks ``chunk_rows`` (from 0, its
    rows), their sorted voxel lists ``voxels`` (``counts`` per chunk) and
    non-zeros ``chunk_nnz`` (without the padding).
    """

    r0: int
    r1: int
    indptr: np.ndarray
    local: np.ndarray
    data: np.ndarray
    scale: np.ndarray | None
    chunk_rows: np.ndarray
    voxels: np.ndarray
    counts: np.ndarray
    chunk_nnz: np.ndarray

    @property
    def nnz(self) -> int:
        return int(self.chunk_nnz.sum())


def layout_blocks(source, fmt: str, *, window: int, rows: tuple[int, int] | None = None,
                  max_nnz: int = LAYOUT_BLOCK_NNZ, what: str = "matrix", chunk_cap: int | None = None):
    """The kernel's layout of ``source`` (its rows ``[r0, r1)``, or all), as :class:`LayoutBlock`\\ s in row order.

    Each block of about ``max_nnz`` non-zeros (:func:`row_blocks`) is
    chunked on its own (:func:`build_plan` with ``window`` and ``chunk_cap``, all cores; chunks do not cross a
    block's end) and laid out (:func:`interleave`). A ``compressed-f16`` or
    ``compressed-u16`` ``fmt`` keeps its 16-bit values: each row's decoded
    values are stored as float16 (uint16) times its row scale, which gives
    them back exactly (:func:`half_rows`). One block is in host memory at a
    time. The one code that :class:`~mlemlib.backends._compressed_cuda.DeviceChunked`
    and :func:`write_layout` build the chunks with.

    Raises
    ------
    ValueError
        A row with more non-zeros than ``window``; 16-bit values that a row
        scale does not give back exactly; compressed-u16 row scales of 2^100
        or more (the kernel's one-FMA decode).
    """
    from mlemlib.compressed import values16
    from mlemlib.formats.spec import matrix_format_of

    half = values16(fmt)
    integer = half and matrix_format_of(fmt).integer_codes
    for g0, g1, block, given in row_blocks(source, max_nnz, scales=True, rows=rows):
        p = build_plan(block, window=window, chunk_cap=chunk_cap)
        values, rs = block.data, None
        if half:
            rs, values = half_rows(block, fmt, scale=given, what=what, row0=g0)
            if integer and len(rs) and float(rs.max()) >= U16_SCALE_MAX:
                r = g0 + int(np.argmax(rs >= U16_SCALE_MAX))
                raise ValueError(f"{what}: row {r} has values above 2^116 (row scale {float(rs.max())!r}): "
                                 "the chunked kernel takes compressed-u16 row scales below 2^100")
        pip, ploc, pdat = interleave(block.indptr, p.local, values)
        ip = np.asarray(block.indptr, dtype=np.int64)
        yield LayoutBlock(g0, g1, pip, ploc, pdat, rs, p.chunk_rows, p.voxels, np.diff(p.vptr),
                          np.diff(ip[p.chunk_rows]))


def source_fingerprint(source) -> str:
    """What a layout file is checked against: shape, non-zeros, format and the matrix's content hash.

    The container's own ``checksum`` (of the whole decoded matrix) where it
    has one, else a hash of its row pointer and of rows at its start, middle
    and end (as :func:`mlemlib.mlem.matrix_fingerprint`), and for a matrix in
    memory a hash of all of it.
    """
    import hashlib

    from mlemlib.formats.spec import matrix_format_of
    from mlemlib.matrix import shape_nnz

    (m, n), nnz = shape_nnz(source)
    h = hashlib.sha256(f"{m}x{n}:{nnz}:{matrix_format_of(source).name}".encode())
    checksum = getattr(source, "checksum", None) or (getattr(source, "attrs", None) or {}).get("checksum")
    if isinstance(checksum, (str, bytes)) and checksum:
        h.update(b"checksum:" + (checksum.encode() if isinstance(checksum, str) else checksum))
        return h.hexdigest()
    src = _host_source(source)
    h.update(np.ascontiguousarray(_host_indptr(src)).tobytes())
    if hasattr(src, "read_rows") and m:  # a file without a checksum: rows at its start, middle and end
        spans = sorted({(0, min(m, 1024)), (max(0, m // 2 - 512), min(m, m // 2 + 512)), (max(0, m - 1024), m)})
    else:  # in memory: all of it
        spans = _host_bounds(src, LAYOUT_BLOCK_NNZ)
    for r0, r1 in spans:
        block = _host_rows(src, r0, r1)
        h.update(np.ascontiguousarray(block.indices).tobytes())
        h.update(np.ascontiguousarray(block.data, dtype=np.float32).tobytes())
    return h.hexdigest()


def write_layout(source, path, window: int = DEFAULT_WINDOW, *, max_nnz: int = LAYOUT_BLOCK_NNZ,
                 threads: int | None = None, chunk_cap: int | None = None) -> ChunkLayout:
    """Write the chunked layout of ``source`` to ``path`` (HDF5), streaming block by block; return it opened.

    The file holds the arrays :class:`~mlemlib.backends._compressed_cuda.DeviceChunked`
    holds (:func:`layout_blocks`: ``indptr`` int64 m + 1, ``local`` uint16,
    ``data`` float32 or the 16-bit values of a compressed-f16/-u16 matrix,
    ``scale`` float32 per row for those, ``chunk_rows`` and ``vptr`` int64,
    ``voxels`` int32) and ``nnzptr`` (int64, the non-zeros before each
    chunk: the chunk ranges of several GPUs are balanced on it); attributes
    ``format`` (``mlem-chunks``), ``version``, ``window``, ``chunk_cap`` (the most non-zeros of a chunk,
    None: :data:`MAX_CHUNK_NNZ`), ``shape``,
    ``nnz``, ``source_format``, ``source_fingerprint``
    (:func:`source_fingerprint`) and ``source``. The file appears under its
    name only once complete. ``source``: a matrix path, an opened matrix or one in memory
    (what :func:`row_blocks` reads). ``threads``: the host threads that
    chunk a block (default: Numba's, all cores).

    Raises
    ------
    ValueError
        What :func:`layout_blocks` refuses; a ``window`` outside ``[1, 65536]``; a ``chunk_cap`` below 1 (both
        before the matrix is streamed or anything is written).
    """
    import h5py

    from mlemlib._io import atomic_path
    from mlemlib.compressed import VALUE_DTYPES, values16
    from mlemlib.formats import matrix_format_of, open_matrix
    from mlemlib.matrix import shape_nnz

    if isinstance(source, (str, os.PathLike)):
        with open_matrix(source) as opened:
            return write_layout(opened, path, window, max_nnz=max_nnz, threads=threads, chunk_cap=chunk_cap)
    if threads:
        import numba

        numba.set_num_threads(max(1, min(int(threads), numba.config.NUMBA_NUM_THREADS)))
    window = window_of(window)
    cap = chunk_cap_of(chunk_cap)
    (m, n), nnz = shape_nnz(source)
    fmt = matrix_format_of(source).name
    half = values16(fmt)
    what = str(getattr(source, "path", None) or getattr(source, "source", None) or "matrix")
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        def grow(name, dtype):
            return f.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype, chunks=(_H5_CHUNK,))

        ds = {k: grow(k, VALUE_DTYPES[fmt] if k == "data" and half else (dt or np.float32))
              for k, dt in LAYOUT_ARRAYS.items()}
        if half:
            ds["scale"] = grow("scale", np.float32)

        def put(name, a):
            d = ds[name]
            k = d.shape[0]
            d.resize((k + len(a),))
            d[k:] = a

        put("indptr", np.zeros(1, np.int64))
        put("chunk_rows", np.zeros(1, np.int64))
        put("vptr", np.zeros(1, np.int64))
        put("nnzptr", np.zeros(1, np.int64))
        k = v = z = 0
        for b in layout_blocks(source, fmt, window=window, max_nnz=max_nnz, what=what, chunk_cap=cap):
            put("indptr", b.indptr[1:] + k)
            put("local", b.local)
            put("data", b.data)
            if half:
                put("scale", b.scale)
            put("chunk_rows", b.chunk_rows[1:] + b.r0)
            put("vptr", np.cumsum(b.counts) + v)
            put("nnzptr", np.cumsum(b.chunk_nnz) + z)
            put("voxels", b.voxels)
            k += len(b.local)
            v += int(b.counts.sum())
            z += b.nnz
            log.info("%s: chunked %d of %d rows", what, b.r1, m)
        if z != nnz:
            raise MatrixFormatError(what, f"read {z} non-zeros, header says {nnz}")
        f.attrs.update(format=LAYOUT_FORMAT, version=LAYOUT_VERSION, window=window, shape=(m, n), nnz=nnz,
                       chunk_cap=cap, source_format=fmt, source_fingerprint=source_fingerprint(source), source=what)
    return open_layout(path)


class ChunkLayout:
    """A layout file of :func:`write_layout`, opened and checked (:func:`open_layout`).

    The per-chunk arrays (``chunk_rows``, ``vptr``, ``nnzptr``: one entry per
    chunk) are in memory; the rest is read by :meth:`read` in pieces.
    Attributes: ``path``, ``shape``, ``nnz``, ``window``, ``format`` (the
    source's), ``fingerprint``, ``half``, ``value_dtype``.
    """

    def __init__(self, path) -> None:
        import h5py

        self.path = os.fspath(path)
        try:
            self._f = h5py.File(self.path, "r")
        except OSError as exc:
            raise MatrixFormatError(self.path, f"not a readable HDF5 file ({_first_line(exc)}): make it again "
                                    "with mlem chunk") from exc
        try:
            self._check()
        except BaseException:
            self._f.close()
            raise

    def _fault(self, fault: str) -> MatrixFormatError:
        return MatrixFormatError(self.path, f"{fault}: make it again with mlem chunk")

    def _check(self) -> None:
        from mlemlib.compressed import VALUE_DTYPES, values16

        f, a = self._f, self._f.attrs
        if a.get("format") != LAYOUT_FORMAT:
            raise self._fault(f"format {a.get('format')!r}, expected {LAYOUT_FORMAT!r} (a chunked layout)")
        if int(a.get("version", -1)) != LAYOUT_VERSION:
            raise self._fault(f"version {a.get('version')!r}, expected {LAYOUT_VERSION}")
        for key in ("shape", "nnz", "window", "source_format", "source_fingerprint"):
            if key not in a:
                raise self._fault(f"attribute {key!r} missing")
        try:
            m, n = (int(v) for v in a["shape"])
            self.shape = (m, n)
            self.nnz = int(a["nnz"])
            self.window = int(a["window"])
            self.format = str(a["source_format"])
            self.fingerprint = str(a["source_fingerprint"])
            self.source = str(a.get("source", ""))
        except (KeyError, TypeError, ValueError) as exc:
            raise self._fault(f"an attribute is malformed ({_first_line(exc)})") from None
        self.half = values16(self.format)
        self.value_dtype = np.dtype(VALUE_DTYPES[self.format] if self.half else np.float32)
        want = dict(LAYOUT_ARRAYS, data=self.value_dtype, **({"scale": np.float32} if self.half else {}))
        for name, dt in want.items():
            if name not in f or f[name].dtype != np.dtype(dt) or f[name].ndim != 1:
                got = f"{f[name].dtype}" if name in f else "missing"
                raise self._fault(f"dataset {name!r} {got}, expected {np.dtype(dt)}")
        self.chunk_rows = self.read("chunk_rows")
        self.vptr = self.read("vptr")
        self.nnzptr = self.read("nnzptr")
        c = len(self.chunk_rows)
        lengths = {"indptr": m + 1, "vptr": c, "nnzptr": c, "voxels": int(self.vptr[-1]) if c else -1,
                   "scale": m}
        for name, length in lengths.items():
            if name in want and f[name].shape[0] != length:
                raise self._fault(f"dataset {name!r} has {f[name].shape[0]} entries, expected {length} (truncated?)")
        stored = int(self.read("indptr", m, m + 1)[0])
        for name in ("local", "data"):
            if f[name].shape[0] != stored:
                raise self._fault(f"dataset {name!r} has {f[name].shape[0]} entries, the row pointer ends at {stored}")
        if (c < 1 or self.chunk_rows[0] != 0 or self.chunk_rows[-1] != m or (np.diff(self.chunk_rows) <= 0).any()
                or self.vptr[0] != 0 or (np.diff(self.vptr) < 0).any() or self.nnzptr[0] != 0
                or self.nnzptr[-1] != self.nnz or (np.diff(self.nnzptr) < 0).any()):
            raise self._fault("its chunk arrays are inconsistent")
        if not 1 <= self.window <= MAX_WINDOW or (np.diff(self.vptr) > self.window).any():
            raise self._fault(f"window {self.window} out of range or exceeded")

    @property
    def chunks(self) -> int:
        return len(self.chunk_rows) - 1

    @property
    def reuse(self) -> float:
        """Non-zeros per voxel-list entry (what ``auto`` decides from, exactly)."""
        return self.nnz / int(self.vptr[-1]) if int(self.vptr[-1]) else 1.0

    def read(self, name: str, a: int | None = None, b: int | None = None) -> np.ndarray:
        """Entries ``[a, b)`` of dataset ``name`` (all by default); a damaged file is one line naming it.
        The set-up phase ``read``, with the bytes read."""
        try:
            ds = self._f[name]
            lo, hi, _ = slice(a, b).indices(len(ds))
            with phase("read", nbytes=max(0, hi - lo) * ds.dtype.itemsize):
                return np.asarray(ds[slice(a, b)])
        except OSError as exc:  # a truncated or damaged file
            raise self._fault(f"dataset {name!r} is corrupt ({_first_line(exc)})") from exc

    def rows_of(self, chunks: tuple[int, int]) -> tuple[int, int]:
        """The rows ``[chunk_rows[c0], chunk_rows[c1])`` of the chunks ``[c0, c1)``."""
        c0, c1 = (int(v) for v in chunks)
        if not 0 <= c0 <= c1 <= self.chunks:
            raise ValueError(f"{self.path}: chunks [{c0}, {c1}) outside its {self.chunks}")
        return int(self.chunk_rows[c0]), int(self.chunk_rows[c1])

    def device_bytes(self, chunks: tuple[int, int] | None = None) -> int:
        """Bytes the chunks ``[c0, c1)`` (or all) take on a GPU (:attr:`DeviceChunked.nbytes`)."""
        c0, c1 = (0, self.chunks) if chunks is None else (int(v) for v in chunks)
        r0, r1 = self.rows_of((c0, c1))
        e0, e1 = (int(v) for v in self.read("indptr", r0, r1 + 1)[[0, -1]])
        per = 2 + self.value_dtype.itemsize
        # row pointer, elements, voxel lists, chunk_rows and vptr (8 bytes each), launch order (4), row scales
        return (8 * (r1 - r0 + 1) + per * (e1 - e0) + 4 * int(self.vptr[c1] - self.vptr[c0]) + 16 * (c1 - c0 + 1)
                + 4 * (c1 - c0) + (4 * (r1 - r0) if self.half else 0))

    def ranges(self, parts: int) -> list[tuple[int, int]]:
        """The chunks split into ``parts`` contiguous, nnz-balanced ranges :func:`chunk_ranges`."""
        return chunk_ranges(self.nnzptr, parts)

    def check_source(self, source) -> None:
        """Refuse (one line naming the file) a layout made from another matrix than ``source``.

        Raises
        ------
        MatrixFormatError
            The source's shape, non-zeros, format or content hash differ from those the file was made from.
        """
        from mlemlib.matrix import shape_nnz

        (m, n), nnz = shape_nnz(source)
        if (m, n) != self.shape or nnz != self.nnz:
            raise self._fault(f"chunks of a {self.shape[0]} x {self.shape[1]} matrix with {self.nnz} non-zeros, "
                              f"not of this {m} x {n} one with {nnz} (stale)")
        got = source_fingerprint(source)
        if got != self.fingerprint:
            raise self._fault(f"chunks of another matrix (fingerprint {self.fingerprint[:12]}, the matrix's is "
                              f"{got[:12]}; stale)")

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> ChunkLayout:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_layout(path, source=None) -> ChunkLayout:
    """Open and check a layout file of :func:`write_layout`; with ``source``, check it was made from it.

    Raises
    ------
    MatrixFormatError
        One line naming the file: not a layout file, truncated or
        inconsistent, or (with ``source``) made from another matrix.
    """
    layout = ChunkLayout(path)
    if source is not None:
        try:
            layout.check_source(source)
        except BaseException:
            layout.close()
            raise
    return layout


def chunk_ranges(nnzptr: np.ndarray, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges ``[c0, c1)`` of chunks, balanced on non-zeros, covering every chunk once.

    ``nnzptr``: the non-zeros before each chunk (chunks + 1 entries, from 0).
    The split of :func:`mlemlib.partition.balanced_bounds` with chunks for
    rows; a range may be empty where there are fewer chunks than parts.
    """
    from mlemlib.partition import balanced_bounds

    b = balanced_bounds(np.asarray(nnzptr, dtype=np.int64), parts)
    return [(int(b[i]), int(b[i + 1])) for i in range(len(b) - 1)]


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]
