"""CuPy launchers of ``mlemlib/kernels/compressed.cu``: the compressed matrix and the one-pass iteration on a GPU.

Provides

- :class:`DeviceCompressed` — a :class:`~mlemlib.compressed.CompressedMatrix`
  in GPU memory (:meth:`DeviceCompressed.from_host`);
- :func:`upload_csr` — CSR arrays in GPU memory for the CSR one-pass kernels
  (any object with ``indptr``, ``indices``, ``data``, ``shape`` on the device,
  e.g. :class:`mlemlib.backends._cuda_kernels.DeviceCSR`, works as well);
- :func:`spmv` — ``y = A x`` on a compressed matrix (also ``A^T c`` on a
  compressed ``A^T``), with the fused epilogues of ``spmv.cu``; deterministic;
- :func:`scatter` — ``A^T c`` from the rows of a compressed ``A``
  (atomics, or deterministic fixed point);
- :func:`onepass` — the one-pass MLEM step (``fp = A f``, ``c = g / fp``,
  ``bp = A^T c`` in one pass over ``A``) on CSR or compressed, with float
  atomics or deterministic 64-bit fixed point; :func:`onepass_fixed` and
  :func:`fixed_to_float` are its two halves for a multi-GPU all-reduce of the
  integer partial sums;
- :func:`fixed_scale`, :func:`onepass_bound` — the fixed-point scale and the
  default bound it is chosen from;
- :class:`DeviceChunked`, :func:`chunked_onepass`, :func:`chunked_forward` —
  a CSR matrix on the GPU as the row chunks of :mod:`mlemlib.chunked` (6 bytes
  per non-zero and each chunk's voxel list) and the deterministic one pass
  through them (kernel ``onepass_chunked``).

CuPy is imported inside the functions: importing this module needs neither
CuPy nor a GPU. Nothing here synchronises the device, except the fixed-point
paths with ``check=True`` (one 4-byte read of the overflow flag) and the
default bounds (a reduction read back to the host).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlemlib import setup_times
from mlemlib._io import prefetched
from mlemlib.backends import _cuda_plan as plan
from mlemlib.backends._build import COMPRESSED, check_vector, cupy, pinned
from mlemlib.backends._build import function as _function
from mlemlib.backends.base import FIXED_RETRIES, FIXED_RETRY_FACTOR
from mlemlib.backends.device_formats import DeviceMatrix
from mlemlib.compressed import VALUE_DTYPES, format_of_values, values16
from mlemlib.errors import ConfigError, DeviceError, MatrixFormatError
from mlemlib.formats.spec import CSR, MatrixFormat, matrix_format_of
from mlemlib.matrix import chunk_bounds

log = logging.getLogger(__name__)

#: Lanes per row the kernels are compiled for.
LANE_CHOICES = (4, 8, 16, 32)
#: Threads per block of the row kernels (compressed.cu's CMP_THREADS).
THREADS = 256
#: Cap of a row launch in full waves of the device: 0, no cap, one row per lane group, which keeps
#: neighbouring rows in flight together (the kernels loop over rows past the cap).
WAVES = 0
#: Non-zeros per block a CSR source is read and encoded in on its way to the GPU.
UPLOAD_CHUNK_NNZ = 1 << 26
#: A streamed upload of a container cuts its rows into at least this many pieces (a power of two of
#: slots, at most UPLOAD_CHUNK_NNZ, at least UPLOAD_MIN_PIECE): a GPU's row block of a multi-GPU job
#: gets smaller page-locked buffers (four shards of Matrix 3 at once: 1.37 s with pieces of 2^24 slots,
#: 2.16 s with 2^26; one GPU, the whole matrix: 1.42 s with 2^26, 2.99 s with 2^24).
UPLOAD_PIECES = 64
UPLOAD_MIN_PIECE = 1 << 22
#: Kernel name part of a values dtype (its ``dtype.char``): float32, float16, uint16.
VALUE_NAMES = {"f": "f32", "e": "f16", "H": "u16"}
#: Rows per unit of the float-atomic scatter's spread launch order (:func:`spread`): rows in flight
#: together then add into voxels far apart. The one passes, which gather f, and the fixed point keep
#: the rows in order (unit 0).
SCATTER_SPREAD_UNIT = 1
#: Epilogues of :func:`spmv` (as spmv.cu).
MODE_PLAIN, MODE_CORR, MODE_UPDATE = 0, 1, 2
#: Fixed point: the bound maps below 2**FIXED_HEADROOM_BITS (of 64).
FIXED_HEADROOM_BITS = 62


def kernel_source() -> str:
    """Text of ``mlemlib/kernels/compressed.cu``, its headers included (:func:`mlemlib.backends._build.kernel_source`)."""
    from mlemlib.backends._build import kernel_source as source

    return source("compressed")


def function(name: str) -> Any:
    """Kernel ``name`` of compressed.cu, compiled for the current device (memoized)."""
    return _function(COMPRESSED, name)


def _device_shape(device_id: int) -> tuple[int, int]:
    from mlemlib.backends._cuda_kernels import device_properties

    p = device_properties(device_id)
    return p["sm_count"], p["max_threads_per_sm"]


def _grid(items: int, items_per_block: int, waves: int | None) -> tuple[int, int]:
    """(blocks, threads) of a launch of :data:`THREADS`-thread blocks (:func:`mlemlib.backends._cuda_plan.launch_shape`)."""
    sms, per_sm = _device_shape(cupy().cuda.Device().id)
    return plan.launch_shape(items, items_per_block, sms, per_sm, threads=THREADS,
                             waves=WAVES if waves is None else waves)


def spread(m: int, unit: int = 0) -> tuple[int, tuple[np.int64, np.int64]]:
    """The launch order of the atomic kernels over ``m`` rows: (lane groups to launch, their ``(P, U)``).

    Lane group ``w`` takes row ``spread_rows(w, P, U, m)``: the units of ``unit`` consecutive rows
    (0: in order) in the order ``u P mod units``
    (:func:`~mlemlib.backends._cuda_plan.spread_stride`), so that the rows in flight together lie all
    over the matrix; ``(1, 1)`` and ``m`` groups keep the rows in order.
    """
    u = int(unit)
    units = -(-m // u) if u > 0 else 0
    p = plan.spread_stride(units) if u > 0 else 1
    if p == 1:
        return m, (np.int64(1), np.int64(1))
    return units * u, (np.int64(p), np.int64(u))


def _launch_rows(fn: Any, m: int, lanes: int, args: tuple, waves: int | None = None) -> None:
    """Launch a row kernel: ``lanes`` per row, grid-stride, capped at ``waves`` full waves (default
    :data:`WAVES`; 0: no cap, one row per lane group: what kernels without a row loop need)."""
    blocks, threads = _grid(m, THREADS // lanes, waves)
    fn((blocks,), (threads,), args)


#: ``CU_LIMIT_PERSISTING_L2_CACHE_SIZE`` (``cuCtxSetLimit``): the L2 set aside for persisting lines.
_CU_LIMIT_PERSISTING_L2 = 6


def _driver() -> Any:
    """``libcuda`` through ctypes (CuPy has no call for L2 persistence); OSError without one."""
    import ctypes

    return ctypes.CDLL("libcuda.so.1")


def persist_in_l2(stream: Any, buf: Any) -> dict | None:
    """Set L2 aside for ``buf`` (a CuPy array on the current device) and put it in a persisting
    access-policy window on ``stream``: the kernels launched there keep its lines in L2 while they stream
    other data past it. The set-aside is the window (at most the device's maximum, the hit ratio scaled
    down beyond it), for the current device's context; :func:`release_l2` gives it back.

    Returns the sizes used, or None (and nothing set) where the device or driver has no such control
    (MIG, MPS, a set-aside maximum of 0, no ``libcuda``). Through the driver
    API with ctypes: CuPy has no call for it.
    """
    import ctypes

    cp = cupy()
    if int(buf.nbytes) == 0:
        return None
    dev = cp.cuda.Device().id
    try:
        max_aside = int(cp.cuda.runtime.deviceGetAttribute(108, dev))  # cudaDevAttrMaxPersistingL2CacheSize
        max_window = int(cp.cuda.runtime.deviceGetAttribute(109, dev))  # cudaDevAttrAccessPolicyMaxWindowSize
        drv = _driver()
    except (OSError, cp.cuda.runtime.CUDARuntimeError) as exc:
        log.debug("GPU %d: no L2 persistence (%s)", dev, exc)
        return None
    nbytes = min(int(buf.nbytes), max_window)
    aside = min(nbytes, max_aside)
    if aside <= 0:
        return None

    class _Window(ctypes.Structure):  # CUaccessPolicyWindow
        _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t), ("hitRatio", ctypes.c_float),
                    ("hitProp", ctypes.c_int), ("missProp", ctypes.c_int)]

    window = _Window(buf.data.ptr, nbytes, aside / nbytes, 2, 1)  # hits persisting, misses streaming
    value = (ctypes.c_char * 64)()  # CUstreamAttrValue: a union of 64 bytes
    ctypes.memmove(value, ctypes.byref(window), ctypes.sizeof(window))
    drv.cuCtxResetPersistingL2Cache()  # lines an earlier window left
    rc = drv.cuCtxSetLimit(ctypes.c_int(_CU_LIMIT_PERSISTING_L2), ctypes.c_size_t(aside))
    if rc == 0:
        rc = drv.cuStreamSetAttribute(ctypes.c_void_p(stream.ptr), ctypes.c_int(1), value)  # ACCESS_POLICY_WINDOW
    if rc != 0:
        drv.cuCtxSetLimit(ctypes.c_int(_CU_LIMIT_PERSISTING_L2), ctypes.c_size_t(0))
        log.debug("GPU %d: no L2 persistence (driver error %d)", dev, rc)
        return None
    return {"window_bytes": nbytes, "set_aside_bytes": aside, "hit_ratio": round(aside / nbytes, 4),
            "max_set_aside_bytes": max_aside}


def release_l2() -> None:
    """Drop the current device's persisting L2 lines and its set-aside (after :func:`persist_in_l2`)."""
    import ctypes

    try:
        drv = _driver()
    except OSError:
        return
    drv.cuCtxResetPersistingL2Cache()
    drv.cuCtxSetLimit(ctypes.c_int(_CU_LIMIT_PERSISTING_L2), ctypes.c_size_t(0))


def choose_lanes(mean_slots_per_row: float, cap: int = 32) -> int:
    """Lanes per row: the power of two at or above the mean row length (one slot per lane per trip), in [4, cap]."""
    if cap not in LANE_CHOICES:
        raise ValueError(f"cap must be one of {LANE_CHOICES}, got {cap}")
    if not math.isfinite(mean_slots_per_row) or mean_slots_per_row <= LANE_CHOICES[0]:
        return LANE_CHOICES[0]
    lanes = 1 << math.ceil(math.log2(mean_slots_per_row))
    return int(min(max(lanes, LANE_CHOICES[0]), cap))


def onepass_lanes(m: int, nnz: int, fmt: str) -> int:
    """Lanes per row of the one passes, from the whole matrix's mean row length (4 slots per lane and trip on
    a compressed format: the format's ``slots_per_lane``): every GPU, and one GPU alone, sums each row the
    same way."""
    return choose_lanes((nnz / m if m else 0.0) / matrix_format_of(fmt).slots_per_lane)


def _lanes(lanes: int | None, default: int) -> int:
    lanes = default if lanes is None else int(lanes)
    if lanes not in LANE_CHOICES:
        raise ConfigError("lanes", f"lanes per row must be one of {LANE_CHOICES}, got {lanes}")
    return lanes


# --------------------------------------------------------------------------- matrices on the device
@dataclass
class DeviceCompressed(DeviceMatrix):
    """A compressed matrix in GPU memory (arrays as in :class:`mlemlib.compressed.CompressedMatrix`).

    The device type of the ``compressed``, ``compressed-f16`` and ``compressed-u16`` formats
    (:mod:`mlemlib.backends.device_formats`): :meth:`upload` takes a
    compressed container (only the rows asked for are read, still encoded),
    an in-memory :class:`~mlemlib.compressed.CompressedMatrix`, or any CSR
    source, which is encoded on the host block by block on the way (how a
    stored CSR ``A^T`` reaches the GPU compressed).
    """

    rowbase: Any
    rowoff: Any
    codes: Any
    values: Any
    scale: Any | None
    shape: tuple[int, int]
    nnz: int
    code_bits: int = 8

    @classmethod
    def from_host(cls, a) -> DeviceCompressed:
        """Upload a :class:`~mlemlib.compressed.CompressedMatrix` (its row pointer must start at slot 0;
        set-up phase ``to_gpu``)."""
        cp = cupy()
        if a.shape[0] >= 0 and int(a.rowbase[0]) + int(a.rowoff[0]) != 0:
            raise ValueError("the row pointer must start at slot 0 (use row_range or read_encoded, which rebase)")
        with setup_times.phase("to_gpu", device=True):
            scale = cp.asarray(a.scale) if a.scale is not None else None
            return cls(
                cp.asarray(a.rowbase), cp.asarray(a.rowoff), cp.asarray(a.codes), cp.asarray(a.values), scale,
                a.shape, a.nnz, int(getattr(a, "code_bits", 8)),
            )

    @property
    def format(self) -> str:  # type: ignore[override]
        return format_of_values(self.values.dtype)

    @classmethod
    def upload(
        cls, source: Any, rows: tuple[int, int] | None = None, *, device: int | None = None, align: bool = False,
        what: str = "matrix", fmt: str | None = None,
    ) -> DeviceCompressed:
        """Rows ``[r0, r1)`` (or all) of ``source`` on ``device``, compressed (``align`` is implied: rows start at 4 slots)."""
        cp = cupy()
        dev = cp.cuda.Device().id if device is None else int(device)
        if isinstance(source, DeviceCompressed) and rows is None:
            return source
        m = int(source.shape[0])
        r0, r1 = (0, m) if rows is None else (int(rows[0]), int(rows[1]))
        with cp.cuda.Device(dev):
            same = fmt is None or getattr(source, "format", None) == fmt
            if same and hasattr(source, "read_encoded") and hasattr(source, "read_slotptr"):
                return cls._stream(source, r0, r1, what)
            return cls.from_host(_encoded_rows(source, r0, r1, fmt or getattr(source, "format", None) or "compressed", what))

    @classmethod
    def _stream(cls, source: Any, r0: int, r1: int, what: str) -> DeviceCompressed:
        """Rows ``[r0, r1)`` of a compressed container, read, validated and copied piece by piece.

        The device arrays are allocated once from the slot pointer; each piece
        of :func:`upload_piece` slots is read (still encoded) and
        checked on a helper thread while the piece before it is copied, so the
        host holds a piece or two and the row pointer, never the whole block.
        A container that reads into given buffers (``read_encoded_into``) gets
        two page-locked buffers, used in turn: a piece is read into one while
        the other's copy runs asynchronously on a stream of its own, and a
        buffer is read into again once its last copy has finished; its columns
        and values are then checked on the device (:func:`device_check`, the
        host's checks on a GPU), and the first bad row's piece is read and
        checked again on the host for the one-line message.
        """
        from mlemlib.compressed import CODE_DTYPES, pack_rowptr

        cp = cupy()
        sp = np.asarray(source.read_slotptr(r0, r1), dtype=np.int64)
        rel = sp - sp[0]
        total = int(rel[-1])
        rowbase, rowoff = pack_rowptr(rel)
        scaled = matrix_format_of(source).row_scales
        codes = cp.empty(total, dtype=CODE_DTYPES[int(source.code_bits)])
        values = cp.empty(total, dtype=VALUE_DTYPES[source.format])
        scale = cp.empty(r1 - r0, dtype=cp.float32) if scaled else None
        nnz = 0
        pieces = chunk_bounds(rel, upload_piece(total))
        stream = cp.cuda.Stream(non_blocking=True)
        stream.wait_event(cp.cuda.get_current_stream().record())  # after what last used the pool's memory
        into = hasattr(source, "read_encoded_into") and pieces
        if into:
            cap = max(int(rel[b] - rel[a]) for a, b in pieces)
            with setup_times.phase("to_gpu"):
                buffers = [(pinned(cap, codes.dtype), pinned(cap, values.dtype)) for _ in range(2)]
            copied: list[Any] = [None, None]  # the event of the last copy out of each buffer

            def read(k: int):
                if copied[k % 2] is not None:
                    copied[k % 2].synchronize()
                a, b = pieces[k]
                return source.read_encoded_into(r0 + a, r0 + b, *buffers[k % 2], check=False)
        else:
            def read(k: int):
                a, b = pieces[k]
                return source.read_encoded(r0 + a, r0 + b)
        # Piece k + 1 is read and checked (columns in range, values finite and >= 0) while piece k is copied
        # (set-up phases wait_read: this thread waits for a piece; to_gpu: the copies).
        encoded = prefetched(read, range(len(pieces)))
        for k, (a, b) in enumerate(pieces):
            with setup_times.phase("wait_read"):
                enc = next(encoded)
            lo, hi = int(rel[a]), int(rel[b])
            with setup_times.phase("to_gpu"):
                if hi > lo:
                    codes[lo:hi].set(enc.codes, stream=stream)
                    values[lo:hi].set(enc.values, stream=stream)
                if scale is not None and b > a:
                    scale[a:b].set(enc.scale, stream=stream)
                if into:
                    copied[k % 2] = stream.record()
                else:
                    stream.synchronize()
            nnz += int(enc.nnz)
            if len(pieces) > 8 and (k + 1) % max(1, len(pieces) // 10) == 0:
                log.info("%s: rows %d..%d on GPU %d: %d of %d slots copied", what, r0, r1,
                         cp.cuda.Device().id, hi, total)
        with setup_times.phase("to_gpu", device=True):
            stream.synchronize()
            if into:
                del buffers, enc
            out = cls(cp.asarray(rowbase), cp.asarray(rowoff), codes, values, scale,
                      (r1 - r0, int(source.shape[1])), nnz, int(source.code_bits))
        if into:
            with setup_times.phase("check", device=True):
                bad, out.nnz = device_check(out)
            if bad is not None:
                a, b = next((a, b) for a, b in pieces if a <= bad < b)
                source.read_encoded(r0 + a, r0 + b)  # raises the host's message
                raise MatrixFormatError(source.source, f"row {r0 + bad}: its columns or values fail the check on "
                                                       "the GPU (and pass the host's)")
        return out


    @staticmethod
    def device_bytes(source: Any) -> int:
        """Bytes ``source`` takes on the GPU: a compressed container's own size, else about 6.5 per non-zero."""
        nb = getattr(source, "nbytes", None)
        if matrix_format_of(source).compressed and nb is not None:
            return int(nb)
        return int(6.5 * int(source.nnz)) + 5 * int(source.shape[0])

    @property
    def lossless(self) -> bool:
        return self.scale is None

    @property
    def slots(self) -> int:
        return int(self.codes.size)

    @property
    def nbytes(self) -> int:
        extra = self.scale.nbytes if self.scale is not None else 0
        return int(self.rowbase.nbytes + self.rowoff.nbytes + self.codes.nbytes + self.values.nbytes + extra)

    def lanes(self, cap: int = 32) -> int:
        """Default lanes per row: from the mean quads (4 slots, one lane's share of a trip) per row."""
        return choose_lanes(self.slots / 4 / self.shape[0] if self.shape[0] else 0.0, cap)

    def max_value(self) -> float:
        """An upper bound of the matrix's values (exact for float32; ``max(scale) * 2**16`` for 16-bit values)."""
        cp = cupy()
        if self.slots == 0:
            return 0.0
        if self.scale is None:
            high = (1 << self.code_bits) - 2  # codes from here on are markers
            return float(cp.max(cp.where(self.codes < high, self.values, cp.float32(0))))
        top = 65536.0 if self.values.dtype == np.uint16 else 32768.0  # the row's values below top * scale
        return float(cp.max(self.scale)) * top if self.scale.size else 0.0

    def kernel_args(self) -> tuple:
        """``(rp, roff, idx, val, scale)`` as the kernels take them."""
        return (self.rowbase, self.rowoff, self.codes, self.values, self.scale if self.scale is not None else self.values)

    @property
    def kind(self) -> str:
        """Kernel name part: values and code bits, ``f32c8``, ``f32c16``, ``f16c8``, ``f16c16``, ``u16c8`` or ``u16c16``."""
        return f"{VALUE_NAMES[self.values.dtype.char]}c{self.code_bits}"


def upload_piece(slots: int) -> int:
    """Slots per piece of a streamed upload of ``slots`` slots (:data:`UPLOAD_PIECES`)."""
    want = max(UPLOAD_MIN_PIECE, int(slots) // UPLOAD_PIECES)
    return int(min(UPLOAD_CHUNK_NNZ, 1 << (want.bit_length() - 1)))


def device_check(a: DeviceCompressed) -> tuple[int | None, int]:
    """The first row of ``a`` whose columns leave ``[0, n)`` or whose values are not finite and >= 0 (or a
    float32 row with a high marker), None if none, and ``a``'s element count: ``ccheck_<kind>`` on its GPU."""
    cp = cupy()
    m, n = a.shape
    out = cp.array([np.iinfo(np.uint64).max, 0], dtype=cp.uint64)  # first bad row, elements
    if m:
        blocks = min((m * 32 + THREADS - 1) // THREADS, 1 << 16)  # a warp per row, grid-stride past 2^19 rows
        function(f"ccheck_{a.kind}")((blocks,), (THREADS,), (a.rowbase, a.rowoff, a.codes, a.values, np.int64(m),
                                                               np.int64(n), out[0:1], out[1:2]))
    first, nnz = (int(v) for v in out.get())
    return (None if first >= m else first), nnz


@dataclass
class DeviceCSRArrays:
    """CSR arrays in GPU memory: int64 ``indptr`` (from 0), int32 ``indices``, float32 ``data``."""

    indptr: Any
    indices: Any
    data: Any
    shape: tuple[int, int]

    @property
    def nnz(self) -> int:
        return int(self.indices.size)


def _encoded_rows(source: Any, r0: int, r1: int, fmt: str, what: str):
    """Rows ``[r0, r1)`` of any matrix source as a host :class:`~mlemlib.compressed.CompressedMatrix`.

    A compressed container or in-memory compressed matrix of format ``fmt``
    gives its own encoding (``read_encoded`` / ``row_range``); anything else
    (CSR, or another compressed format) is read as CSR block by block and
    encoded in ``fmt`` with one code width for all blocks (chosen on the first
    block).
    """
    from mlemlib.compressed import CompressedMatrix

    if getattr(source, "format", None) == fmt:  # a compressed source of this format: its own encoding
        if hasattr(source, "read_encoded"):
            return source.read_encoded(r0, r1)
        if isinstance(source, CompressedMatrix):
            return source.row_range(r0, r1)
    from mlemlib.formats import open_source

    src = open_source(source, what)
    parts, bits = [], None
    ip = np.asarray(src.read_indptr(), dtype=np.int64)[r0 : r1 + 1]
    for a, b in chunk_bounds(ip, UPLOAD_CHUNK_NNZ):
        block = src.read_rows(r0 + a, r0 + b)
        with setup_times.phase("encode"):
            enc = CompressedMatrix.from_csr(block, fmt, code_bits=bits, validate=False)
        bits = enc.code_bits
        parts.append(enc)
    if not parts:
        block = src.read_rows(r0, r1)
        with setup_times.phase("encode"):
            return CompressedMatrix.from_csr(block, fmt, validate=False)
    log.info("%s: rows %d..%d encoded as %s (%d-bit codes) on the way to the GPU", what, r0, r1, fmt, bits)
    with setup_times.phase("encode"):
        return parts[0] if len(parts) == 1 else CompressedMatrix.concatenate(parts)


def upload_csr(a) -> DeviceCSRArrays:
    """Upload a host :class:`~mlemlib.matrix.CSRMatrix` (``indptr`` rebased to 0; set-up phase ``to_gpu``)."""
    cp = cupy()
    ip = np.asarray(a.indptr, dtype=np.int64)
    with setup_times.phase("to_gpu", device=True):
        return _csr_arrays(cp, ip, a)


def _csr_arrays(cp: Any, ip: np.ndarray, a: Any) -> DeviceCSRArrays:
    return DeviceCSRArrays(
        cp.asarray(ip - ip[0]),
        cp.asarray(np.asarray(a.indices, dtype=np.int32)),
        cp.asarray(np.asarray(a.data, dtype=np.float32)),
        tuple(a.shape),
    )


def _matrix_args(a) -> tuple[MatrixFormat, str, tuple, float]:
    """(format, kernel name part, the five matrix arguments, mean slots per row) of a compressed or CSR device
    matrix."""
    if isinstance(a, DeviceCompressed):
        m = a.shape[0]
        return matrix_format_of(a), a.kind, a.kernel_args(), (a.slots / 4 / m if m else 0.0)
    if all(hasattr(a, k) for k in ("indptr", "indices", "data", "shape")):
        m = a.shape[0]
        nnz = int(a.indices.size)
        return CSR, CSR.kernel_kind(), (a.indptr, a.indptr, a.indices, a.data, a.data), (nnz / m if m else 0.0)
    raise TypeError(f"expected a DeviceCompressed or device CSR arrays, got {type(a).__name__}")


# --------------------------------------------------------------------------- fixed point
def fixed_scale(bound: float) -> float:
    """The power of two ``scale`` with ``bound * scale < 2**62`` (``2**62`` for a bound of 0).

    Each fixed-point term is then off by at most ``0.5 / scale <= bound * 2**-62``.

    Raises
    ------
    ValueError
        For a negative or non-finite bound.
    """
    bound = float(bound)
    if not math.isfinite(bound) or bound < 0:
        raise ValueError(f"fixed-point bound must be finite and >= 0, got {bound}")
    if bound == 0:
        return 2.0**FIXED_HEADROOM_BITS
    _, e = math.frexp(bound)  # bound < 2**e
    k = min(max(FIXED_HEADROOM_BITS - e, -1000), 1000)
    return math.ldexp(1.0, k)


#: Column counts at or above this are not exact in ``ccount_<kind>``'s float32 sums.
_COUNT_EXACT = 1 << 24


def column_count_max(a: Any) -> int:
    """The most elements any column of a device matrix holds (stored zeros included); computed once per matrix.

    A :class:`DeviceCompressed` is counted by ``ccount_<kind>`` (its columns decoded as the scatter
    decodes them, a float32 atomic add of 1 per element: exact below 2^24; a larger count gives the
    matrix's ``nnz``, which bounds it as well); CSR arrays by ``bincount`` of their columns; a
    :class:`DeviceChunked` by the chunks whose voxel lists hold each voxel (the adds its kernel makes
    into one voxel's sum).
    """
    cached = getattr(a, "_column_count_max", None)
    if cached is not None:
        return cached
    cp = cupy()
    m, n = a.shape
    if m == 0 or n == 0:
        k = 0
    elif isinstance(a, DeviceCompressed):
        counts = cp.zeros(n, dtype=cp.float32)
        groups, order = spread(m, 0)
        _launch_rows(function(f"ccount_{a.kind}"), groups, 32, (*a.kernel_args(), counts, np.int64(m), *order))
        k = int(cp.max(counts))
        if k >= _COUNT_EXACT:
            k = int(a.nnz)
        del counts
    elif isinstance(a, DeviceChunked):  # a voxel gets one add per chunk whose voxel list holds it
        k = int(cp.max(cp.bincount(a.voxels, minlength=n))) if int(a.voxels.size) else 0
    else:
        k = int(cp.max(cp.bincount(a.indices, minlength=n)))
    try:
        a._column_count_max = k
    except AttributeError:  # an object that takes no new attributes: counted again next time
        pass
    return k


def fixed_limits(terms: int, gpus: int = 1) -> tuple[int, int]:
    """``(red_lim, sum_lim)`` of the fixed-point kernels' adds, where no output gets more than ``terms``
    terms over all ``gpus`` GPUs (the sum of each GPU's :func:`column_count_max`).

    A term below ``red_lim = 2^63 // terms`` is added without reading the sum back: all of them
    together add less than 2^63 to an output. A larger one is checked against ``sum_lim = 2^63 // gpus``:
    the kernel flags a GPU's sum that reaches it. While no flag is set, no GPU's sum and no all-reduced
    sum reaches 2^64. ``terms = 0`` gives ``red_lim = 2^63``.
    """
    terms, gpus = int(terms), int(gpus)
    if terms < 0 or gpus < 1:
        raise ValueError(f"fixed_limits needs terms >= 0 and gpus >= 1, got {terms} and {gpus}")
    return (1 << 63) // max(terms, 1), (1 << 63) // gpus


def _limits(a: Any, limits: tuple[int, int] | None) -> tuple[np.uint64, np.uint64]:
    """The kernels' ``red_lim, sum_lim`` arguments: ``limits``, or one GPU's from ``a``'s column counts."""
    red, top = limits if limits is not None else fixed_limits(column_count_max(a))
    return np.uint64(red), np.uint64(top)


def onepass_bound(g: Any, f: Any) -> float:
    """Upper bound of every ``bp_j`` with ``f_j > 0`` in a one-pass step: ``sum(g) / min(f_j > 0)``.

    From ``sum_j f_j bp_j = sum_i c_i fp_i <= sum_i g_i`` with every term
    >= 0. Voxels with ``f_j = 0`` are not covered (their ``bp_j`` may exceed
    it; the fixed-point kernels then flag an overflow and :func:`onepass`
    retries). On several GPUs use the global ``sum(g)`` so every GPU takes the
    same scale. Reads two reductions back to the host.
    """
    cp = cupy()
    total = float(cp.sum(g, dtype=cp.float64))
    pos = f[f > 0]
    if total <= 0 or pos.size == 0:
        return 0.0
    return total / float(cp.min(pos))


def fixed_to_float(acc: Any, out: Any, scale: float) -> Any:
    """``out = acc / scale`` as float32 (the deterministic kernels' final step)."""
    cp = cupy()
    n = int(acc.size)
    if acc.dtype != cp.uint64 or out.dtype != cp.float32 or out.size != n:
        raise ValueError("acc must be uint64 and out float32 of the same length")
    if n:
        blocks, threads = _grid(n, THREADS, None)
        function("fixed_to_float")((blocks,), (threads,), (acc, out, np.int64(n), np.float64(1.0 / scale)))
    return out


# --------------------------------------------------------------------------- launches
def spmv(
    a: DeviceCompressed,
    x: Any,
    out: Any = None,
    *,
    lanes: int | None = None,
    mode: int = MODE_PLAIN,
    aux0: Any = None,
    aux1: Any = None,
    **_: Any,
) -> Any:
    """``out = A x`` on a compressed matrix (the back projection on a compressed ``A^T`` likewise).

    ``mode`` as :func:`mlemlib.backends._cuda_kernels.spmv`: ``MODE_CORR``
    writes ``aux0 / (A x)`` (0 where ``A x`` is 0), ``MODE_UPDATE`` writes
    ``aux0 * (A x) / aux1`` (``aux0 * (A x)`` where ``aux1`` is 0; ``out`` may
    be ``aux0``). Deterministic. Returns ``out``. The registry's launcher of ``delta_vector``; other
    kernels' keywords (``kernel``, ``secsize``, ...) are ignored.
    """
    if not isinstance(a, DeviceCompressed):
        raise TypeError("spmv takes a DeviceCompressed (CSR has mlemlib.backends._cuda_kernels.spmv)")
    from mlemlib.backends._cuda_kernels import spmv_vectors

    m, n = a.shape
    out = spmv_vectors(a.shape, x, out, mode, aux0, aux1)
    if m == 0:
        return out
    L = _lanes(lanes, a.lanes())
    fn = function(f"cspmv_{a.kind}_{L}")
    a0 = aux0 if aux0 is not None else out
    a1 = aux1 if aux1 is not None else out
    _launch_rows(fn, m, L, (*a.kernel_args(), x, out, np.int64(m), np.int32(mode), a0, a1))
    return out


def _fixed_loop(launch, acc: Any, flag: Any, bound: float, check: bool, stats: dict | None,
                scale_of=None) -> float:
    """Run a fixed-point launch, retrying with a larger bound on overflow; return the scale used.

    ``scale_of`` maps a bound to the scale (default :func:`fixed_scale`)."""
    scale_of = scale_of or fixed_scale
    scale = scale_of(bound)
    for attempt in range(FIXED_RETRIES + 1):
        acc.fill(0)
        flag.fill(0)
        launch(scale)
        if not check:
            break
        bad = int(flag.get()[0])
        if bad == 0:
            break
        if attempt == FIXED_RETRIES:
            raise DeviceError(f"fixed-point accumulation overflowed (flag {bad}) after {FIXED_RETRIES} larger bounds")
        log.info("fixed-point overflow (flag %d) at scale 2^%d; retrying", bad, round(math.log2(scale)))
        bound = max(bound, 1e-300) * FIXED_RETRY_FACTOR
        scale = scale_of(bound)
        if stats is not None:
            stats["retries"] = stats.get("retries", 0) + 1
    if stats is not None:
        stats["scale"] = scale
        stats["bound"] = bound
    return scale


def scatter(
    a: DeviceCompressed,
    c: Any,
    out: Any = None,
    *,
    lanes: int | None = None,
    deterministic: bool = False,
    bound: float | None = None,
    check: bool = True,
    stats: dict | None = None,
    limits: tuple[int, int] | None = None,
    **_: Any,
) -> Any:
    """``out = A^T c`` from the rows of a compressed ``A`` (no transpose).

    With ``deterministic=False`` float atomics (order-dependent); with
    ``True`` 64-bit fixed point (bit-reproducible), its scale from ``bound``
    (default ``sum(c) * max(A)``, which bounds every output). ``stats``
    receives ``scale``, ``bound`` and ``retries``; ``limits``: :func:`fixed_limits` (default: this
    matrix alone's). Returns ``out``. The registry's launcher of
    ``delta_scatter``; other kernels' keywords (``kernel``, ``smem``, ...) are ignored.
    """
    cp = cupy()
    m, n = a.shape
    check_vector("c", c, m)
    if out is None:
        out = cp.empty(n, dtype=cp.float32)
    check_vector("out", out, n)
    L = _lanes(lanes, a.lanes())
    args = a.kernel_args()
    if not deterministic:
        out.fill(0)
        if m:
            groups, order = spread(m, SCATTER_SPREAD_UNIT)
            _launch_rows(function(f"cscatter_{a.kind}_{L}"), groups, L, (*args, c, out, np.int64(m), *order))
        return out
    if bound is None:
        bound = float(cp.sum(c, dtype=cp.float64)) * a.max_value()
    acc = cp.empty(n, dtype=cp.uint64)
    flag = cp.zeros(1, dtype=cp.int32)
    fn = function(f"cscatter_det_{a.kind}_{L}")
    lims = _limits(a, limits)

    groups, order = spread(m, 0)  # the fixed point's 64-bit atomics in row order

    def launch(scale: float) -> None:
        if m:
            _launch_rows(fn, groups, L, (*args, c, acc, np.float64(scale), flag, *lims, np.int64(m), *order))

    scale = _fixed_loop(launch, acc, flag, bound, check, stats)
    return fixed_to_float(acc, out, scale)


def _step_vectors(shape: tuple[int, int], g: Any, f: Any, bp: Any, fp: Any) -> tuple[Any, Any]:
    """A one-pass step's vectors checked (g and fp: m entries; f and bp: n), bp and fp allocated when None."""
    cp = cupy()
    m, n = shape
    check_vector("g", g, m)
    check_vector("f", f, n)
    bp = cp.empty(n, dtype=cp.float32) if bp is None else bp
    fp = cp.empty(m, dtype=cp.float32) if fp is None else fp
    check_vector("bp", bp, n)
    check_vector("fp", fp, m)
    return bp, fp


def _background(bg: Any, m: int) -> Any:
    """The one-pass kernels' background argument: ``bg`` (checked: float32, one per row of the launch's
    rows) or the null pointer (no background)."""
    if bg is None:
        return np.uint64(0)
    check_vector("bg", bg, m)
    return bg


def onepass_fixed(
    a: Any,
    g: Any,
    f: Any,
    acc: Any,
    fp: Any,
    scale: float,
    flag: Any,
    *,
    lanes: int | None = None,
    bg: Any = None,
    limits: tuple[int, int] | None = None,
) -> None:
    """The deterministic one-pass kernel alone: ``acc += rint(c_i a_ij * scale)``, ``fp = A f``.

    ``c_i = g_i / (fp_i + bg_i)`` (0 where that is 0); ``bg`` None: no background (``g_i / fp_i``).

    ``acc`` (uint64, n) must be zero (or hold other GPUs' partial sums of
    the same scale) and ``flag`` (int32, 1) zero; nothing is synchronised.
    For several GPUs: every GPU runs this on its row block with the same
    ``scale`` (and ``lanes``), the ``acc`` arrays are summed as uint64
    (e.g. an NCCL all-reduce), then :func:`fixed_to_float` gives ``bp``:
    bit-identical for every GPU count. ``limits``: :func:`fixed_limits` of every GPU's block (default:
    ``a`` alone's, one GPU).
    """
    fmt, kind, args, mean = _matrix_args(a)
    m, n = a.shape
    L = _lanes(lanes, choose_lanes(mean))
    if m:
        lims = _limits(a, limits)
        groups, order = spread(m)
        _launch_rows(
            function(fmt.onepass_kernel(kind, L, True)), groups, L,
            (*args, f, g, _background(bg, m), fp, acc, np.float64(scale), flag, *lims, np.int64(m), *order),
            waves=None if fmt.compressed else 0,  # the CSR kernels have no row loop
        )


def onepass(
    a: Any,
    g: Any,
    f: Any,
    *,
    bp: Any = None,
    fp: Any = None,
    lanes: int | None = None,
    deterministic: bool = False,
    bound: float | None = None,
    check: bool = True,
    stats: dict | None = None,
    acc: Any = None,
    bg: Any = None,
) -> tuple[Any, Any]:
    """One-pass MLEM step on the GPU: ``fp = A f``, ``c = g / (fp + bg)`` (0 where that is 0; ``bg`` None:
    ``g / fp``), ``bp = A^T c``.

    Parameters
    ----------
    a
        A :class:`DeviceCompressed` or device CSR arrays (:func:`upload_csr`,
        :class:`~mlemlib.backends._cuda_kernels.DeviceCSR`).
    g, f
        float32 CuPy vectors (m and n).
    bp, fp
        Outputs (float32, n and m), allocated when None.
    lanes
        Lanes per row (default from the mean row length). For bit-identical
        results across GPU counts every GPU must use the same value.
    deterministic
        False: float atomics (fast, order-dependent). True: 64-bit fixed
        point (bit-reproducible), its scale from ``bound`` (default
        :func:`onepass_bound`), retried with a larger bound on overflow when
        ``check`` (one flag read).
    stats
        Receives ``scale``, ``bound``, ``retries`` (deterministic only).
    acc
        The fixed point's uint64 accumulator (n; deterministic only), allocated when None.

    Returns
    -------
    (bp, fp)
    """
    cp = cupy()
    _, _, _, mean = _matrix_args(a)
    n = a.shape[1]
    bp, fp = _step_vectors(a.shape, g, f, bp, fp)
    L = _lanes(lanes, choose_lanes(mean))
    if not deterministic:
        onepass_step(a, g, f, fp=fp, bp=bp, lanes=L, bg=bg)
        return bp, fp
    if bound is None:
        bound = onepass_bound(g, f)
    if acc is None:
        acc = cp.empty(n, dtype=cp.uint64)
    elif acc.dtype != cp.uint64 or acc.size != n:
        raise ValueError(f"acc must be uint64 of length {n}")
    flag = cp.zeros(1, dtype=cp.int32)

    def launch(scale: float) -> None:
        onepass_fixed(a, g, f, acc, fp, scale, flag, lanes=L, bg=bg)

    scale = _fixed_loop(launch, acc, flag, bound, check, stats)
    fixed_to_float(acc, bp, scale)
    return bp, fp


def onepass_step(a: Any, g: Any, f: Any, *, fp: Any, bp: Any = None, lanes: int | None = None, bg: Any = None,
                 **_: Any) -> None:
    """One GPU's part of a ``onepass`` iteration: ``fp = A_k f`` and the terms ``c_i a_ij`` of its rows
    (``c_i = g_i / (fp_i + bg_i)``, ``bg`` None: ``g_i / fp_i``) added into ``bp`` (zeroed here) with
    float atomics (not deterministic). Returns None (no fixed-point scale). Several GPUs add their
    ``bp``. Nothing is synchronised.
    """
    fmt, kind, args, mean = _matrix_args(a)
    m = a.shape[0]
    L = _lanes(lanes, choose_lanes(mean))
    bp.fill(0)
    if m:
        groups, order = spread(m)
        _launch_rows(function(fmt.onepass_kernel(kind, L, False)), groups, L,
                     (*args, f, g, _background(bg, m), fp, bp, np.int64(m), *order),
                     waves=None if fmt.compressed else 0)  # the CSR kernels have no row loop


def onepass_fixed_step(a: Any, g: Any, f: Any, *, fp: Any, acc: Any = None, flag: Any = None, bound: float = 1.0,
                       lanes: int | None = None, bg: Any = None, limits: tuple[int, int] | None = None,
                       **_: Any) -> float:
    """One GPU's part of a ``onepass_fixed`` iteration: ``fp = A_k f`` and the terms ``c_i a_ij`` of its
    rows added into ``acc`` (uint64, zero on entry, as ``flag``) as 64-bit fixed point of the scale that
    :func:`fixed_scale` gives ``bound``; returns that scale. Several GPUs add their ``acc`` and convert
    with :func:`fixed_to_float`; the fixed point is then the same bits for every GPU count. ``limits``:
    :func:`fixed_limits` of all GPUs' blocks (default: ``a`` alone's). Nothing is synchronised.
    """
    _, _, _, mean = _matrix_args(a)
    scale = fixed_scale(bound)
    onepass_fixed(a, g, f, acc, fp, scale, flag, lanes=_lanes(lanes, choose_lanes(mean)), bg=bg, limits=limits)
    return scale


# --------------------------------------------------------------------------- the chunked one pass
#: Threads per block of ``chunked_onepass`` (compressed.cu's CHUNK_THREADS).
CHUNK_THREADS = 1024
#: The chunked kernel's terms stay below 2**CHUNK_HEADROOM_BITS (two 32-bit shared words per voxel).
CHUNK_HEADROOM_BITS = 52
#: Shared-memory bytes per voxel of a chunk's window: f, and the two words of its sum.
CHUNK_SMEM_PER_VOXEL = 12


def chunk_scale(bound: float) -> float:
    """The power of two ``scale`` with ``bound * scale < 2**52`` (the chunked kernel's fixed point)."""
    return fixed_scale(bound) / 2.0 ** (FIXED_HEADROOM_BITS - CHUNK_HEADROOM_BITS)


def chunk_window(device_id: int | None = None) -> int:
    """Voxels per chunk on a device: :data:`mlemlib.chunked.DEFAULT_WINDOW`, less where its shared memory is smaller."""
    from mlemlib import chunked

    cp = cupy()
    dev = cp.cuda.Device().id if device_id is None else int(device_id)
    optin = int(cp.cuda.runtime.getDeviceProperties(dev).get("sharedMemPerBlockOptin", 0)) or 48 * 1024
    # less the kernel's few bytes of static shared memory (its row counter)
    return max(2, min(chunked.DEFAULT_WINDOW, ((optin - 64) // CHUNK_SMEM_PER_VOXEL) & ~1))


@dataclass
class DeviceChunked:
    """A CSR matrix on the GPU as the row chunks of :mod:`mlemlib.chunked` (the ``onepass_chunked`` kernel's input).

    ``indptr`` (int64, m + 1), ``data`` (float32) and, per non-zero, its
    16-bit index ``local`` into its chunk's voxel list, in the kernel's row
    layout (:func:`mlemlib.chunked.interleave`: rows padded with zeros to a
    multiple of 4 elements, whole groups of 128 interleaved for vector
    loads); chunk ``c`` holds rows ``[chunk_rows[c], chunk_rows[c + 1])``
    and voxels ``voxels[vptr[c]:vptr[c + 1]]``. No column indices: 6 bytes
    per stored element (non-zeros and at most 3 zeros per row) plus the voxel
    lists (4 bytes per non-zero / :attr:`reuse`). ``order`` (int32, one per
    chunk) is the order the kernel starts them in
    (:func:`mlemlib.chunked.launch_order`, set by :meth:`upload` and
    :meth:`from_layout` for the GPU they load on).
    """

    indptr: Any
    local: Any
    data: Any
    chunk_rows: Any
    vptr: Any
    voxels: Any
    shape: tuple[int, int]
    window: int
    nnz: int  # non-zeros (the stored elements add the rows' padding)
    scale: Any = None  # float32[m] row scales of 16-bit values (compressed-f16: powers of two; -u16), else None
    format: str = "csr"  # the source's format: csr and compressed keep float32 values, the 16-bit formats theirs
    order: Any = None  # int32[chunks]: the launch order (set_launch_order; a launch makes it where missing)

    @property
    def half(self) -> bool:
        """Whether the values are 16 bits (float16 or uint16, times :attr:`scale`)."""
        return self.scale is not None

    @property
    def kernel(self) -> str:
        """The kernel that reads these values: ``chunked_onepass`` (float32), ``_f16`` or ``_u16``."""
        return "chunked_onepass" + (f"_{VALUE_NAMES[self.data.dtype.char]}" if self.half else "")

    @property
    def chunks(self) -> int:
        return int(self.chunk_rows.size) - 1

    @property
    def reuse(self) -> float:
        """Non-zeros per voxel-list entry: how many times fewer global atomics than one per non-zero."""
        return self.nnz / int(self.voxels.size) if int(self.voxels.size) else 1.0

    @property
    def nbytes(self) -> int:
        arrays = (self.indptr, self.local, self.data, self.chunk_rows, self.vptr, self.voxels)
        extra = [x for x in (self.scale, self.order) if x is not None]
        return int(sum(x.nbytes for x in arrays)) + int(sum(x.nbytes for x in extra))

    def set_launch_order(self) -> None:
        """:attr:`order` for the current GPU: :func:`mlemlib.chunked.launch_order` of the chunks' stored elements
        over its multiprocessors."""
        from mlemlib import chunked

        cp = cupy()
        sizes = (self.indptr[self.chunk_rows[1:]] - self.indptr[self.chunk_rows[:-1]]).get()
        sms = int(cp.cuda.Device().attributes["MultiProcessorCount"])
        self.order = cp.asarray(chunked.launch_order(sizes, sms))

    def lanes(self, cap: int = 32) -> int:
        """32: a warp per row."""
        return 32

    @staticmethod
    def device_bytes(source: Any) -> int:
        """Bytes on the GPU before the plan exists: 8 per row (12 with 16-bit values' row scales), 6 per element
        (4 with 16-bit values) for the non-zeros and the padding (at most 3 per row), 1 more per non-zero for
        voxel lists of reuse 4."""
        from mlemlib import chunked
        from mlemlib.matrix import shape_nnz

        (m, _), nnz = shape_nnz(source)
        half = matrix_format_of(source).row_scales
        per = 4 if half else 6
        return (12 if half else 8) * (m + 1) + per * (chunked.VEC - 1) * m + (per + 1) * nnz

    @classmethod
    def upload(cls, source: Any, rows: tuple[int, int] | None = None, *, device: int | None = None,
               window: int | None = None, what: str = "matrix", max_nnz: int = UPLOAD_CHUNK_NNZ,
               sms: int | None = None) -> DeviceChunked:
        """Chunk ``source`` (its rows ``[r0, r1)``, or all) on ``device`` (default: the current GPU): an opened
        matrix file (CSR or compressed), a host CSR or compressed matrix, or a device CSR.

        Streams: the plan is built block by block of about ``max_nnz``
        non-zeros on the host (:func:`mlemlib.chunked.layout_blocks`, all
        cores, the code :func:`mlemlib.chunked.write_layout` writes a file
        with), its local indices and values copied into place in the kernel's
        layout; chunks do not cross a block's end. :meth:`from_layout` loads
        such a file instead, with no chunking. A ``compressed-f16`` or ``compressed-u16`` source keeps its 16-bit
        values: each row's decoded values are stored as float16 (uint16) times
        its row scale, which gives them back exactly (4 bytes per
        non-zero instead of 6).
        ``window`` defaults to :func:`chunk_window`. ``sms``: the GPU's multiprocessors, where given a share too
        small to make :data:`~mlemlib.chunked.CHUNK_WAVES` chunks of up to
        :data:`~mlemlib.chunked.MAX_CHUNK_NNZ` non-zeros per multiprocessor is cut finer
        (:func:`~mlemlib.chunked.chunk_cap_for`). A row block (a GPU's part of a
        partition) is chunked on its own: a row's products and its terms' fixed
        point do not depend on its chunk, so every split gives the same sums.

        Raises
        ------
        ValueError
            A row with more non-zeros than ``window``; 16-bit values that a
            row scale does not give back exactly; compressed-u16 row scales of 2^100 or more.
        """
        import time

        from mlemlib import chunked
        from mlemlib.matrix import shape_nnz

        cp = cupy()
        if device is not None:
            with cp.cuda.Device(int(device)):
                return cls.upload(source, rows, window=window, what=what, max_nnz=max_nnz, sms=sms)
        window = chunk_window() if window is None else int(window)
        (m_all, n), nnz = shape_nnz(source)
        fmt = matrix_format_of(source).name
        r_lo, r_hi = (0, m_all) if rows is None else (int(rows[0]), int(rows[1]))
        if not 0 <= r_lo <= r_hi <= m_all:
            raise ValueError(f"{what}: rows [{r_lo}, {r_hi}) outside the matrix's {m_all}")
        m = r_hi - r_lo
        if rows is not None:
            ip = chunked._host_indptr(chunked._host_source(source))
            nnz = int(ip[r_hi] - ip[r_lo])
        half = values16(fmt)
        t0 = time.perf_counter()
        indptr = cp.empty(m + 1, dtype=cp.int64)
        indptr[0] = 0
        # the rows' padding is known block by block: room for the most (the unused end is never read)
        room = nnz + (chunked.VEC - 1) * m
        local = cp.empty(room, dtype=cp.uint16)
        data = cp.empty(room, dtype=VALUE_DTYPES[fmt] if half else cp.float32)
        scale = cp.empty(m, dtype=cp.float32) if half else None
        chunk_rows, counts, voxels = [np.zeros(1, np.int64)], [], []
        k = 0  # stored elements
        read = 0  # non-zeros
        # set-up phases: chunk (the next block read, chunked and laid out; its reads are phases of their
        # own), to_gpu (its copies)
        cap = chunked.chunk_cap_for(nnz, sms) if sms else None
        blocks = chunked.layout_blocks(source, fmt, window=window, rows=rows, max_nnz=max_nnz, what=what,
                                       chunk_cap=cap)
        while True:
            with setup_times.phase("chunk"):
                b = next(blocks, None)
            if b is None:
                break
            r0, r1 = b.r0 - r_lo, b.r1 - r_lo  # rows of this block
            n_b = len(b.local)
            with setup_times.phase("to_gpu", device=True):
                if half:
                    scale[r0:r1] = cp.asarray(b.scale)
                indptr[r0 + 1 : r1 + 1] = cp.asarray(b.indptr[1:] + k)
                local[k : k + n_b] = cp.asarray(b.local)
                data[k : k + n_b] = cp.asarray(b.data)
                voxels.append(cp.asarray(b.voxels))  # on the device block by block: the host holds one block
            chunk_rows.append(b.chunk_rows[1:] + r0)
            counts.append(b.counts)
            k += n_b
            read += b.nnz
            del b
            if m and r1 < m and (r1 * 10 // m) != (r0 * 10 // m):
                log.info("%s: chunked %d of %d rows (%.0f s)", what, r1, m, time.perf_counter() - t0)
        if read != nnz:
            raise DeviceError(f"{what}: read {read} non-zeros, header says {nnz}")
        vptr = np.zeros(sum(len(c) for c in counts) + 1, dtype=np.int64)
        if counts:
            np.cumsum(np.concatenate(counts), out=vptr[1:])
        with setup_times.phase("to_gpu", device=True):
            vox = cp.concatenate(voxels) if voxels else cp.empty(0, dtype=cp.int32)
            del voxels
            out = cls(indptr, local[:k], data[:k], cp.asarray(np.concatenate(chunk_rows)), cp.asarray(vptr), vox,
                      (m, n), window, nnz, scale, fmt)
            out.set_launch_order()
        log.info("%s: %d chunks of <= %d voxels and <= %d non-zeros, reuse %.2f, %.3f bytes per non-zero on the "
                 "GPU, in %.1f s", what, out.chunks, window, cap or chunked.MAX_CHUNK_NNZ, out.reuse,
                 out.nbytes / max(nnz, 1), time.perf_counter() - t0)
        return out

    @classmethod
    def from_layout(cls, layout: Any, chunks: tuple[int, int] | None = None, *, device: int | None = None,
                    max_nnz: int = UPLOAD_CHUNK_NNZ) -> DeviceChunked:
        """Load a layout file (:func:`mlemlib.chunked.write_layout`; a path or an opened
        :class:`~mlemlib.chunked.ChunkLayout`) on ``device`` (default: the current GPU), with no chunking.

        ``chunks``: only the chunks ``[c0, c1)`` (a GPU's share), their rows
        ``[chunk_rows[c0], chunk_rows[c1])`` rebased to 0; default all. Read
        in pieces of about ``max_nnz`` elements (one piece in host memory at a
        time). The arrays equal :meth:`upload`'s of the same matrix, window and
        blocks.

        Raises
        ------
        ConfigError
            The layout's window is larger than the device's :func:`chunk_window`
            (one line naming the file).
        MatrixFormatError
            A damaged file (:meth:`~mlemlib.chunked.ChunkLayout.read`).
        """
        import time

        from mlemlib import chunked

        cp = cupy()
        if device is not None:
            with cp.cuda.Device(int(device)):
                return cls.from_layout(layout, chunks, max_nnz=max_nnz)
        if not isinstance(layout, chunked.ChunkLayout):
            with chunked.open_layout(layout) as opened:
                return cls.from_layout(opened, chunks, max_nnz=max_nnz)
        fits = chunk_window()
        if layout.window > fits:
            raise ConfigError(layout.path, f"chunks of {layout.window} voxels, more than this GPU's shared memory "
                              f"holds ({fits}): make it with mlem chunk --window {fits}")
        t0 = time.perf_counter()
        c0, c1 = (0, layout.chunks) if chunks is None else (int(v) for v in chunks)
        r0, r1 = layout.rows_of((c0, c1))
        ip = layout.read("indptr", r0, r1 + 1)
        e0, e1 = int(ip[0]), int(ip[-1])
        v0, v1 = int(layout.vptr[c0]), int(layout.vptr[c1])
        step = max(1, int(max_nnz))

        def load(name: str, a: int, b: int, dtype: Any) -> Any:
            # piece k + 1 read from the file while piece k is copied to the GPU (set-up phases wait_read, to_gpu)
            out = cp.empty(b - a, dtype=dtype)
            spans = [(p, min(b, p + step)) for p in range(a, b, step)]
            pieces = prefetched(lambda span: layout.read(name, *span), spans)
            for p, q in spans:
                with setup_times.phase("wait_read"):
                    host = next(pieces)
                with setup_times.phase("to_gpu", device=True):
                    out[p - a : q - a] = cp.asarray(host)
            return out

        out = cls(cp.asarray(ip - e0), load("local", e0, e1, cp.uint16), load("data", e0, e1, layout.value_dtype),
                  cp.asarray(layout.chunk_rows[c0 : c1 + 1] - r0), cp.asarray(layout.vptr[c0 : c1 + 1] - v0),
                  load("voxels", v0, v1, cp.int32), (r1 - r0, layout.shape[1]), layout.window,
                  int(layout.nnzptr[c1] - layout.nnzptr[c0]),
                  load("scale", r0, r1, cp.float32) if layout.half else None, layout.format)
        out.set_launch_order()
        log.info("%s: chunks [%d, %d) of %d (rows [%d, %d)), reuse %.2f, %.3f bytes per non-zero on the GPU, "
                 "loaded in %.1f s", layout.path, c0, c1, layout.chunks, r0, r1, out.reuse,
                 out.nbytes / max(out.nnz, 1), time.perf_counter() - t0)
        return out


def _chunk_launch(a: DeviceChunked, g: Any, f: Any, fp: Any, acc: Any, scale: float, flag: Any, fwd_only: int,
                  bg: Any = None, limits: tuple[int, int] | None = None) -> None:
    """Launch the chunked kernel: a chunk's sum for a voxel below ``limits``' ``red_lim`` is added as a
    reduction, a larger one is checked, and a global sum reaching its ``sum_lim`` sets bit 1 of ``flag``
    (:func:`fixed_limits` of all GPUs; None: one GPU's, from :func:`column_count_max`). ``fwd_only`` adds
    nothing."""
    if a.chunks == 0:
        return
    fn = function(a.kernel)
    w = a.window + (a.window & 1)
    shared = CHUNK_SMEM_PER_VOXEL * w
    if fn.max_dynamic_shared_size_bytes < shared:
        fn.max_dynamic_shared_size_bytes = shared
    rscale = a.scale if a.half else a.data  # not read for float32 values
    if a.order is None:
        a.set_launch_order()
    red, top = (np.uint64(0), np.uint64(1 << 63)) if fwd_only else _limits(a, limits)
    fn((a.chunks,), (CHUNK_THREADS,), (a.order, a.chunk_rows, a.vptr, a.voxels, a.indptr, a.local, a.data, rscale, f, g,
                                       _background(None if fwd_only else bg, a.shape[0]), fp, acc, np.float64(scale),
                                       flag, red, top, np.int32(w), np.int32(fwd_only)),
       shared_mem=shared)


def chunked_step(a: DeviceChunked, g: Any, f: Any, *, fp: Any, bp: Any = None, acc: Any = None, flag: Any = None,
                 bound: float = 1.0, lanes: int | None = None, bg: Any = None, limits: tuple[int, int] | None = None,
                 **_: Any) -> float:
    """One GPU's part of a chunked one pass (``onepass_chunked``), as :func:`onepass_step`'s fixed point:
    ``fp = A_k f`` and the terms into ``acc`` (zero on entry, as ``flag``) at the scale :func:`chunk_scale`
    gives ``bound``, which it returns. ``bp`` and ``lanes`` are not used (a warp per row). ``limits``:
    :func:`fixed_limits` of all GPUs (default: one GPU's, from :func:`column_count_max`, the most chunks
    that hold one voxel)."""
    del bp, lanes
    scale = chunk_scale(bound)
    _chunk_launch(a, g, f, fp, acc, scale, flag, 0, bg, limits)
    return scale


def chunked_forward(a: DeviceChunked, f: Any, out: Any = None) -> Any:
    """``out = A f`` through the chunks (the chunked kernel without its scatter); deterministic."""
    cp = cupy()
    m, n = a.shape
    check_vector("f", f, n)
    if out is None:
        out = cp.empty(m, dtype=cp.float32)
    check_vector("out", out, m)
    flag = cp.zeros(1, dtype=cp.int32)
    _chunk_launch(a, f, f, out, cp.empty(1, dtype=cp.uint64), 1.0, flag, 1)  # g unused with fwd_only
    return out


def chunked_onepass(
    a: DeviceChunked,
    g: Any,
    f: Any,
    *,
    bp: Any = None,
    fp: Any = None,
    bound: float | None = None,
    check: bool = True,
    stats: dict | None = None,
    acc: Any = None,
    flag: Any = None,
    bg: Any = None,
) -> tuple[Any, Any]:
    """One-pass MLEM step through the chunks: ``fp = A f``, ``c = g / (fp + bg)`` (``bg`` None: ``g / fp``),
    ``bp = A^T c``; deterministic.

    As :func:`onepass` with ``deterministic=True`` (``bound`` default
    :func:`onepass_bound`, retried larger on overflow when ``check``), the
    scale from :func:`chunk_scale`. ``acc`` (uint64, n) and ``flag`` (int32,
    1) are scratch, allocated when None. Returns ``(bp, fp)``.
    """
    cp = cupy()
    n = a.shape[1]
    bp, fp = _step_vectors(a.shape, g, f, bp, fp)
    if bound is None:
        bound = onepass_bound(g, f)
    acc = cp.empty(n, dtype=cp.uint64) if acc is None else acc
    flag = cp.zeros(1, dtype=cp.int32) if flag is None else flag

    def launch(scale: float) -> None:
        _chunk_launch(a, g, f, fp, acc, scale, flag, 0, bg)

    scale = _fixed_loop(launch, acc, flag, bound, check, stats, scale_of=chunk_scale)
    fixed_to_float(acc, bp, scale)
    return bp, fp
