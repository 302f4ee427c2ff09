"""CuPy side of the CUDA kernels: compiled modules, device CSR arrays, launches (CUDA only).

Provides

- :class:`DeviceCSR` — a CSR matrix in GPU memory (int64 row pointer, int32
  columns, float32 values), with its cuSPARSE view (:meth:`DeviceCSR.cusparse`)
  and an on-device transposition (:meth:`DeviceCSR.transpose`);
- one launcher per kernel, which the registry binds (:func:`mlemlib.registry.launcher`):
  the row kernels :func:`csr_vector`, :func:`csr_scalar`, :func:`merge`, :func:`cusparse`
  (``y = A x`` with the fused MLEM epilogues) and the scatters :func:`scatter_atomic`,
  :func:`scatter_vec`, :func:`scatter_smem`, :func:`cusparse_scatter` (``A^T c`` from the
  rows of ``A``); :func:`spmv` and :func:`scatter` call one by its name through the
  registry; :func:`correlate` and :func:`update` (fused elementwise kernels).

CuPy is imported inside the functions: importing this module needs no GPU,
calling it does. Launch shapes come from the device's properties
(:func:`device_properties`) through :mod:`mlemlib.backends._cuda_plan`; every kernel is
compiled through :mod:`mlemlib.backends._build` (``SPMV``, ``RowShape.build``). Nothing
here synchronises the device.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from mlemlib.backends import _cuda_plan as plan
from mlemlib import setup_times
from mlemlib.backends._build import COMPRESSED, Build, check_vector, cupy, function, kernel_source, pinned, prefetch
from mlemlib.backends.device_formats import DeviceMatrix
from mlemlib.devices import cuda_memory_bandwidth
from mlemlib.errors import ConfigError, DeviceError
from mlemlib import matrix as _mx
from mlemlib.matrix import CSRMatrix, slice_rows

log = logging.getLogger(__name__)

#: Epilogues of the row kernels (epilogue.cuh): the product, the correlation ``g / (A f)``, the update
#: ``f * (A^T c) / norm`` (``f`` kept where ``norm`` is NaN), the correlation with a background ``g / (A f + bg)``.
MODE_PLAIN, MODE_CORR, MODE_UPDATE, MODE_CORR_BG = 0, 1, 2, 3
#: Largest nnz cuSPARSE (through CuPy's int32 indices) can take.
CUSPARSE_MAX_NNZ = plan.CUSPARSE_MAX_NNZ
#: Non-zeros per chunk (one block) of ``scatter_smem``.
SMEM_CHUNK_NNZ = 1 << 18
#: Threads per block of ``scatter_smem``.
SMEM_THREADS = 1024
#: The build of spmv.cu without options (csr_vector_L's own launch shape, the scatters, merge).
SPMV = Build("spmv")
#: The build of spmv.cu whose ``scatter_vec_L`` uses sm_90 vector atomics (a compiler without them loses
#: this kernel only).
SPMV_VECTOR_ATOMICS = Build("spmv", ("-DMLEM_VECTOR_ATOMICS",))


def kernel_builds(kernels: Iterable[Any], *, tune: bool = True) -> list[Build]:
    """The builds the registry's cuda ``kernels`` launch, :data:`SPMV` first (the vector operations and
    epilogues every backend runs); a kernel whose launch shape is tuned (``shapes``) brings every build of
    :data:`~mlemlib.backends._cuda_plan.SHAPE_CANDIDATES` where ``tune``."""
    out = [SPMV]
    for k in kernels:
        module_name = (k.launcher or "").split(":")[0]
        if module_name == "_compressed_cuda":
            out.append(COMPRESSED)
        elif k.launcher == "_cuda_kernels:scatter_vec":
            out.append(SPMV_VECTOR_ATOMICS)
        if k.shapes and tune:
            out += [sh.build for sh in plan.SHAPE_CANDIDATES]
    return list(dict.fromkeys(out))


def prefetch_kernels(kernels: Iterable[Any], device_id: int, *, tune: bool = True) -> None:
    """Start compiling :func:`kernel_builds` of ``kernels`` for GPU ``device_id`` in the background
    (:func:`mlemlib.backends._build.prefetch`)."""
    prefetch(kernel_builds(kernels, tune=tune), device_id)


@functools.cache
def device_properties(device_id: int) -> dict[str, Any]:
    """The properties launch shapes need, read once per device."""
    cp = cupy()
    p = cp.cuda.runtime.getDeviceProperties(device_id)
    name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
    return {
        "name": name,
        "sm_count": int(p["multiProcessorCount"]),
        "max_threads_per_sm": int(p["maxThreadsPerMultiProcessor"]),
        "max_threads_per_block": int(p["maxThreadsPerBlock"]),
        "smem_per_block_optin": int(p.get("sharedMemPerBlockOptin", p["sharedMemPerBlock"])),
        "l2_bytes": int(p.get("l2CacheSize", 0)),
        "compute_capability": f"{p['major']}.{p['minor']}",
        "memory_bandwidth": float(cuda_memory_bandwidth(device_id).get("theoretical_bandwidth", 0.0)),
    }


def _device_key() -> dict[str, Any]:
    """The current device's facts a tuning depends on (part of a tuning cache key)."""
    cp = cupy()
    props = device_properties(cp.cuda.Device().id)
    return {"name": props["name"], "compute_capability": props["compute_capability"],
            "cuda_runtime": int(cp.cuda.runtime.runtimeGetVersion())}


@functools.cache
def _kernels_digest() -> str:
    """SHA-256 of spmv.cu as compiled (its headers included): a tuning cache entry is for this code."""
    import hashlib

    return hashlib.sha256(kernel_source("spmv").encode()).hexdigest()


def shape_label(a: Any) -> str:
    """The launch shape ``csr_vector`` runs on ``a`` (a DeviceCSR's tuned ``row_shape``), as text; ``-`` for other formats."""
    if not isinstance(a, DeviceCSR):
        return "-"
    return (a.row_shape or plan.RowShape()).label()


def transpose_lanes(at: DeviceCSR) -> int:
    """Lanes per row of ``csr_vector`` on ``A^T`` (the back projection): as for any matrix, from its mean row length.
    """
    return at.lanes()


@dataclass
class DeviceCSR(DeviceMatrix):
    """A CSR matrix in GPU memory: ``indptr`` int64 (m+1), ``indices`` int32, ``data`` float32.

    The column and value arrays must be 16-byte aligned (the kernels load
    them 16 bytes at a time); fresh CuPy allocations are. Build one with
    :meth:`from_host`, or from CuPy arrays of the right dtypes.
    """

    indptr: Any
    indices: Any
    data: Any
    shape: tuple[int, int]
    _cusparse: Any = field(default=None, repr=False)
    _stats: dict | None = field(default=None, repr=False)
    #: Launch shape of ``csr_vector`` on this matrix (None: csr_vector_L's own; set by :meth:`tune`).
    row_shape: plan.RowShape | None = field(default=None, repr=False)
    #: Milliseconds per candidate shape measured by :meth:`tune`.
    tuned: dict | None = field(default=None, repr=False)
    #: (lanes, layout, candidate labels) of the last tuning: the same question is not timed again.
    tuned_for: tuple | None = field(default=None, repr=False)
    _compact: Any = field(default=None, repr=False)  # compact_rows: None (not computed), False or the rows
    #: Order of each row's elements: 0, by column (canonical: cuSPARSE, the host, the scatter kernels);
    #: L, interleaved for ``csr_vector`` with L lanes per row (:meth:`set_layout`).
    layout: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        cp = cupy()
        self.shape = (int(self.shape[0]), int(self.shape[1]))
        self.indptr = cp.asarray(self.indptr, dtype=cp.int64)
        self.indices = cp.asarray(self.indices, dtype=cp.int32)
        self.data = cp.asarray(self.data, dtype=cp.float32)
        if len(self.indptr) != self.shape[0] + 1 or len(self.indices) != len(self.data):
            raise ValueError(
                f"inconsistent device CSR: shape {self.shape}, {len(self.indptr)} row pointers, "
                f"{len(self.indices)} columns, {len(self.data)} values"
            )
        for nm in ("indices", "data"):
            arr = getattr(self, nm)
            if arr.size and arr.data.ptr % 16:
                log.warning("device CSR %s is not 16-byte aligned: copying it", nm)
                setattr(self, nm, arr.copy())

    format = "csr"

    @classmethod
    def upload(
        cls, source: Any, rows: tuple[int, int] | None = None, *, device: int | None = None, align: bool = False,
        what: str = "matrix", fmt: str | None = None,
    ) -> DeviceCSR:
        """The whole ``source`` (streamed by row blocks; a DeviceCSR returned as is) or rows ``[r0, r1)`` of it.

        See :meth:`mlemlib.backends.device_formats.DeviceMatrix.upload`; a row
        block with ``align`` keeps its first non-zero at its global offset
        modulo :data:`ALIGN` (:func:`rows_to_device`).
        """
        cp = cupy()
        dev = cp.cuda.Device().id if device is None else int(device)
        if rows is None:
            with cp.cuda.Device(dev):
                return load_device(source, what)
        r0, r1 = (int(v) for v in rows)
        return rowsto_device(source, r0, r1, dev, align=align)

    @staticmethod
    def device_bytes(source: Any) -> int:
        """8 bytes per non-zero and 8 per row pointer entry (a DeviceCSR already there: 0)."""
        if isinstance(source, DeviceCSR):
            return 0
        (m, _), nnz = _mx.shape_nnz(source)
        return plan.csr_bytes(m, nnz)

    @classmethod
    def from_host(cls, a: CSRMatrix) -> DeviceCSR:
        """Copy a host :class:`CSRMatrix` to the current GPU (row pointer rebased to 0; set-up phase ``to_gpu``)."""
        cp = cupy()
        indptr = np.asarray(a.indptr, dtype=np.int64)
        if len(indptr) and indptr[0] != 0:
            indptr = indptr - indptr[0]
        with setup_times.phase("to_gpu", device=True):
            return cls(cp.asarray(indptr), cp.asarray(a.indices), cp.asarray(a.data), a.shape)

    def to_host(self) -> CSRMatrix:
        """Copy back to a host :class:`CSRMatrix` (each row by column: the layout is set back to 0 first)."""
        self.set_layout(0)
        return CSRMatrix(self.indptr.get(), self.indices.get(), self.data.get(), self.shape)

    def set_layout(self, lanes: int) -> None:
        """Reorder each row's elements in place: ``lanes`` = 0 by column, else interleaved for ``lanes`` lanes.

        In the interleaved layout (:func:`~mlemlib.backends._cuda_plan.interleave_positions`,
        kernel ``csr_interleave``) the four gathers of each lane of a
        ``csr_vector`` group read consecutive elements of the row instead of
        every fourth one, so each gather instruction touches fewer cache
        lines. The same pairs (column, value) in another order: any kernel
        computes the same product, ``csr_vector`` with other rounding (fixed
        by the layout: runs stay bit-identical), and :meth:`cusparse`,
        :meth:`to_host` and :meth:`transpose` set the layout back to 0 first.
        One pass over the matrix on the GPU, no second copy.
        """
        lanes = int(lanes)
        if lanes and lanes not in plan.LANE_CHOICES:
            raise ConfigError("lanes", f"lanes per row must be 0 or one of {plan.LANE_CHOICES}, got {lanes}")
        if lanes == self.layout:
            return
        cp = cupy()
        self.drop_cusparse()  # its view shares the arrays
        m = self.shape[0]
        if m and self.nnz:
            fn = function(SPMV, "csr_interleave")
            blocks = min(-(-m // 8), 1 << 20)  # 8 warps of a 256-thread block, one row each (grid-stride)
            for to, inverse in ((self.layout, 1), (lanes, 0)):
                if to:
                    fn((blocks,), (256,), (self.indptr, np.int64(m), self.indices, self.data, np.int32(to),
                                          np.int32(inverse)))
            cp.cuda.get_current_stream().synchronize()
        self.layout = lanes

    @property
    def nnz(self) -> int:
        return int(self.indices.size)

    @property
    def nbytes(self) -> int:
        return int(self.indptr.nbytes + self.indices.nbytes + self.data.nbytes)

    def stats(self) -> dict[str, float]:
        """Row-length facts (computed once on the device): mean, max, empty rows."""
        if self._stats is None:
            cp = cupy()
            m = self.shape[0]
            if m:
                lengths = cp.diff(self.indptr)
                self._stats = {
                    "mean_row_length": self.nnz / m,
                    "max_row_length": int(lengths.max()),
                    "empty_rows": int((lengths == 0).sum()),
                }
            else:
                self._stats = {"mean_row_length": 0.0, "max_row_length": 0, "empty_rows": 0}
        return self._stats

    def lanes(self, cap: int = plan.LANE_CHOICES[-1]) -> int:
        """Lanes per row ``csr_vector`` / ``scatter`` take for this matrix (at most ``cap``)."""
        return plan.choose_lanes(self.stats()["mean_row_length"], cap)

    def tune(self, lanes: int, *, candidates=plan.SHAPE_CANDIDATES, repeat: int = 7, cache: Any = None,
             cache_key: dict | None = None) -> plan.RowShape:
        """Time ``csr_vector`` (``lanes`` per row) under each launch shape; keep the fastest as :attr:`row_shape`.

        A shape never changes a result (each row is summed the same way), so
        choosing by time keeps runs bit-identical. Every candidate runs once to
        compile and warm up, then all of them ``repeat`` times in turn between
        CUDA events; the median decides. Candidates a lane count cannot take
        are skipped. (Timing each candidate right after its compilation would
        time a GPU that idled through the compilation.)

        ``cache`` (a :class:`~mlemlib.backends._tune_cache.TuneCache`) and
        ``cache_key`` (:func:`~mlemlib.backends._tune_cache.source_key` of the
        file this matrix was read from; None: not cached): the shape stored for
        this matrix, lanes, layout, candidates, device and kernels is taken
        without timing (nor compiling) the others; a tuning is stored. A matrix already tuned for the
        same lanes, layout and candidates (a backend built again on a matrix on the GPU) keeps its
        shape without timing. The set-up phase ``tune``.
        """
        with setup_times.phase("tune", device=True):
            return self._tune(lanes, candidates, repeat, cache, cache_key)

    def _tune(self, lanes: int, candidates: Any, repeat: int, cache: Any, cache_key: dict | None) -> plan.RowShape:
        cp = cupy()
        m, n = self.shape
        if m == 0 or self.nnz == 0:
            self.row_shape, self.tuned = None, {}
            return plan.RowShape()
        long_rows = self.stats()["max_row_length"] > plan.ROW_KERNEL_MAX_LENGTH
        shapes = [sh for sh in candidates
                  if sh.is_default or (lanes in plan.BLOCK_LANES and not (sh.row_bound and long_rows))]
        question = (lanes, self.layout, tuple(sh.label() for sh in shapes))
        if self.tuned_for == question:  # a matrix on the GPU tuned before (a backend built again on it)
            return self.row_shape or plan.RowShape()
        key = None
        if cache is not None and cache_key is not None:
            from mlemlib.backends import _tune_cache

            key = _tune_cache.tune_key(cache_key, lanes=lanes, layout=self.layout,
                                       candidates=[sh.label() for sh in shapes], device=_device_key(),
                                       kernels=_kernels_digest())
            hit = cache.get(key)
            best = next((sh for sh in shapes if hit is not None and sh.label() == hit["best"]), None)
            if best is not None:
                self.row_shape = None if best.is_default else best
                self.tuned = {str(k): float(v) for k, v in hit["times_ms"].items()}
                self.tuned_for = question
                log.info("csr_vector on %s x %s (%d lanes): %s from the tuning cache %s", m, n, lanes,
                         best.label(), cache.path(key))
                return best
        x = cp.ones(n, dtype=cp.float32)
        y = cp.empty(m, dtype=cp.float32)
        for shape in shapes:  # compile and warm up every build first: the GPU idles while NVRTC runs
            spmv(self, x, y, lanes=lanes, shape=shape)
        events = {sh: [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(repeat)] for sh in shapes}
        for k in range(repeat):  # round robin: a drift of the clocks spreads over every candidate alike
            for shape in shapes:
                start, stop = events[shape][k]
                start.record()
                spmv(self, x, y, lanes=lanes, shape=shape)
                stop.record()
        cp.cuda.get_current_stream().synchronize()
        times = {sh: float(np.median([cp.cuda.get_elapsed_time(a, b) for a, b in ev])) for sh, ev in events.items()}
        best = min(times, key=times.get)
        self.row_shape = None if best.is_default else best
        self.tuned = {sh.label(): t for sh, t in times.items()}
        self.tuned_for = question
        log.info("csr_vector on %s x %s (%d lanes): %s", m, n, lanes,
                 ", ".join(f"{k} {v:.3f} ms" for k, v in self.tuned.items()) + f" -> {best.label()}")
        if key is not None:
            cache.put(key, best.label(), self.tuned)
        return best

    def cusparse(self) -> Any:
        """This matrix as a ``cupyx.scipy.sparse.csr_matrix`` (an int32 row-pointer copy; built once).

        Sets the layout back to columns in order first (:meth:`set_layout`).
        """
        self.set_layout(0)
        if self._cusparse is None:
            if self.nnz > CUSPARSE_MAX_NNZ:
                raise DeviceError(f"cuSPARSE through CuPy takes int32 indices: {self.nnz} non-zeros exceed 2^31 - 1")
            import cupyx.scipy.sparse as cps

            cp = cupy()
            self._cusparse = cps.csr_matrix(
                (self.data, self.indices, self.indptr.astype(cp.int32)), shape=self.shape, copy=False
            )
        return self._cusparse

    def drop_cusparse(self) -> None:
        """Free the cuSPARSE view's int32 row pointer."""
        self._cusparse = None

    def compact_rows(self) -> Any | None:
        """The non-empty rows (int64, cached), or None when at most
        1/8 of the rows are empty.

        ``csr_vector`` given this row list computes the same sums for the
        listed rows and leaves the empty ones' outputs unwritten, so that no
        warp's trip is spent on an empty row (58% of madpet2's rows in the
        scanner's own order: LORs that miss the field of view).
        """
        if self._compact is None:
            cp = cupy()
            m = self.shape[0]
            lengths = cp.diff(self.indptr)
            rows = cp.flatnonzero(lengths).astype(cp.int64)
            self._compact = False if m - rows.size <= m // 8 else rows
        return None if self._compact is False else self._compact

    def launch_rows(self, skip_empty: bool = False) -> Any | None:
        """The row list a ``csr_vector`` launch takes (:meth:`compact_rows` with ``skip_empty``), or None for
        every row in order."""
        return self.compact_rows() if skip_empty else None

    def transpose(self) -> DeviceCSR:
        """``A^T`` as CSR, computed on the GPU with cuSPARSE (csr2csc); rows' columns sorted (set-up phase
        ``transpose``)."""
        cp = cupy()
        m, n = self.shape
        if self.nnz == 0:
            return DeviceCSR(cp.zeros(n + 1, cp.int64), cp.zeros(0, cp.int32), cp.zeros(0, cp.float32), (n, m))
        with setup_times.phase("transpose", device=True):
            t = self.cusparse().T.tocsr()
            return DeviceCSR(t.indptr.astype(cp.int64), t.indices, t.data, (n, m))


def set_row_layouts(a: Any, at: Any, fp_interleaved: bool, bp_interleaved: bool, lanes_fp: int, lanes_bp: int) -> None:
    """Give a backend's ``A`` and ``A^T`` the layouts its kernels read best (:func:`_cuda_plan.row_layouts`,
    :meth:`DeviceCSR.set_layout`); matrices of other formats, and a missing ``A^T``, are left alone.
    Called before the launch shapes are tuned: they are timed on the layout used. The set-up phase ``layout``."""
    if not isinstance(a, DeviceCSR):
        return
    la, lt = plan.row_layouts(fp_interleaved, bp_interleaved, at is not None, lanes_fp, lanes_bp)
    with setup_times.phase("layout", device=True):
        a.set_layout(la)
        if isinstance(at, DeviceCSR):
            at.set_layout(lt)


# --------------------------------------------------------------------------- uploads (DeviceCSR.upload)
#: Rows of a host CSR matrix (:func:`mlemlib.matrix.slice_rows`), under the name the uploads use.
slice_rows_host = slice_rows


def to_device(arr: Any, device: int) -> Any:
    """Copy a host (NumPy) or device (CuPy, any GPU) array to ``device``."""
    cp = cupy()
    with cp.cuda.Device(device):
        if isinstance(arr, cp.ndarray):
            if arr.device.id == device:
                return arr.copy()
            out = cp.empty(arr.shape, dtype=arr.dtype)
            if arr.size:
                out.data.copy_from_device(arr.data, arr.nbytes)
            return out
        return cp.asarray(np.ascontiguousarray(arr))


#: ``csr_vector`` loads 4 non-zeros at a time from index multiples of 4: a row block keeps its
#: global offset modulo this, so each row is summed exactly as in the whole matrix.
ALIGN = 4


def aligned_pad(base: int) -> int:
    """Leading padding that gives a block starting at non-zero ``base`` the same alignment as in the whole matrix."""
    return int(base) % ALIGN


def load_device(matrix: Any, what: str = "matrix") -> DeviceCSR:
    """Put a matrix on the current GPU as :class:`DeviceCSR`.

    Accepts a ``DeviceCSR`` (returned as is), a :class:`CSRMatrix`, a SciPy
    sparse matrix, or an opened matrix with ``iter_chunks`` (``.h5``,
    ``.csr4``), which is streamed row block by row block so the host never
    holds the whole matrix.
    """
    cp = cupy()
    if isinstance(matrix, DeviceCSR):
        return matrix
    if isinstance(matrix, CSRMatrix):
        return DeviceCSR.from_host(matrix)
    if hasattr(matrix, "tocsr"):
        return DeviceCSR.from_host(CSRMatrix.from_scipy(matrix))
    if hasattr(matrix, "read_rows_into"):
        (m, n), nnz = _mx.shape_nnz(matrix)
        log.info("streaming %s (%d x %d, %d nnz, %.2f GiB) to the GPU", what, m, n, nnz, plan.csr_bytes(m, nnz) / float(1 << 30))
        a = upload_rows(matrix, 0, m, cp.cuda.Device().id)
        if a.nnz != nnz:
            raise DeviceError(f"{what}: read {a.nnz} non-zeros, header says {nnz}")
        return a
    if hasattr(matrix, "iter_chunks"):  # another reader of row blocks: each block copied as it comes
        (m, n), nnz = _mx.shape_nnz(matrix)
        indptr, indices, data = cp.empty(m + 1, dtype=cp.int64), cp.empty(nnz, dtype=cp.int32), cp.empty(nnz, dtype=cp.float32)
        indptr[0] = k = 0
        for r0, r1, block in matrix.iter_chunks():
            ip = np.asarray(block.indptr, dtype=np.int64)
            with setup_times.phase("to_gpu", device=True):
                indptr[r0 + 1 : r1 + 1] = cp.asarray(ip[1:] - ip[0] + k)
                indices[k : k + block.nnz] = cp.asarray(block.indices)
                data[k : k + block.nnz] = cp.asarray(block.data)
            k += block.nnz
        if k != nnz:
            raise DeviceError(f"{what}: read {k} non-zeros, header says {nnz}")
        return DeviceCSR(indptr, indices, data, (m, n))
    raise TypeError(f"{what}: expected a CSRMatrix, DeviceCSR or an opened matrix, got {type(matrix).__name__}")


def rowsto_device(source: Any, r0: int, r1: int, device: int, *, align: bool = False) -> DeviceCSR:
    """Rows ``[r0, r1)`` of a matrix source as a ``DeviceCSR`` on ``device``.

    Parameters
    ----------
    source
        An opened matrix (``read_rows``: only that range is read), a
        :class:`CSRMatrix`, a SciPy sparse matrix, or a ``DeviceCSR`` on any GPU.
    r0, r1
        The row range.
    device
        Target GPU.
    align
        Keep the block's first non-zero at its global offset modulo
        :data:`ALIGN`: ``pad = indptr[r0] % 4`` leading zero entries (column
        0, value 0) that no row covers, and a row pointer starting at
        ``pad``. ``csr_vector`` then sums every row in the same order as on
        the whole matrix, so partial results are bit-identical to one GPU's.
        Only for the row kernels (cuSPARSE needs a row pointer starting at 0).
    """
    cp = cupy()
    if isinstance(source, DeviceCSR):
        with cp.cuda.Device(source.indptr.device.id):
            ip = source.indptr[r0 : r1 + 1]
            base, end = int(ip[0]), int(ip[-1])
            pad = aligned_pad(base) if align else 0
            ip = ip - (base - pad)
            idx, val = source.indices[base - pad : end], source.data[base - pad : end]
        with cp.cuda.Device(device), setup_times.phase("to_gpu", device=True):
            idx, val = to_device(idx, device), to_device(val, device)
            if pad:
                idx[:pad] = 0
                val[:pad] = 0
            return DeviceCSR(to_device(ip, device), idx, val, (r1 - r0, source.shape[1]))
    if hasattr(source, "read_rows_into"):
        return upload_rows(source, r0, r1, device, align=align)
    if hasattr(source, "read_rows"):
        block = source.read_rows(r0, r1)
        base = int(_indptr_at(source, r0)) if align else 0
    elif isinstance(source, CSRMatrix):
        block = slice_rows_host(source, r0, r1)
        base = int(source.indptr[r0] - source.indptr[0])
    elif hasattr(source, "tocsr"):
        full = CSRMatrix.from_scipy(source)
        block = slice_rows_host(full, r0, r1)
        base = int(full.indptr[r0])
    else:
        raise TypeError(f"cannot read rows of {type(source).__name__}")
    pad = aligned_pad(base) if align else 0
    with cp.cuda.Device(device):
        if not pad:
            return DeviceCSR.from_host(block)
        ip = np.asarray(block.indptr, dtype=np.int64)
        ip = ip - ip[0] + pad
        idx = np.zeros(block.nnz + pad, dtype=np.int32)
        val = np.zeros(block.nnz + pad, dtype=np.float32)
        idx[pad:] = block.indices[: block.nnz]
        val[pad:] = block.data[: block.nnz]
        with setup_times.phase("to_gpu", device=True):
            return DeviceCSR(cp.asarray(ip), cp.asarray(idx), cp.asarray(val), block.shape)


#: Elements per block of :func:`upload_rows` (32 MiB of columns and 32 MiB of values per staging buffer).
STAGE_NNZ = 1 << 23


def upload_rows(source: Any, r0: int, r1: int, device: int, *, align: bool = False) -> DeviceCSR:
    """Rows ``[r0, r1)`` of an opened matrix (``row_pointer``, ``read_rows_into``) streamed onto ``device`` as a ``DeviceCSR``.

    The rows are read in blocks of about :data:`STAGE_NNZ` elements straight
    into two page-locked staging buffers (a reader thread fills one while the
    other is copied), and each block is copied asynchronously into the
    device arrays, which are allocated once: the host holds 2 blocks, not the
    matrix, and the copies hide behind the reads. ``align``: as in
    :func:`rowsto_device`. Set-up phases: ``read`` and ``checks`` (the
    reader's), ``wait_read`` (this thread waiting for a block), ``to_gpu``
    (issuing the copies and waiting for the last).
    """
    from mlemlib._io import prefetched

    cp = cupy()
    r0, r1 = int(r0), int(r1)
    ip, base = source.row_pointer(r0, r1)  # only the range's row pointer is read
    ip = np.asarray(ip, dtype=np.int64)
    nnz = int(ip[-1])
    pad = aligned_pad(base) if align else 0
    bounds = _mx.chunk_bounds(ip, STAGE_NNZ)
    widest = max((int(ip[b] - ip[a]) for a, b in bounds), default=0)
    with cp.cuda.Device(device):
        stream = cp.cuda.Stream(non_blocking=True)
        indices = cp.zeros(nnz + pad, dtype=cp.int32) if pad else cp.empty(nnz, dtype=cp.int32)
        data = cp.zeros(nnz + pad, dtype=cp.float32) if pad else cp.empty(nnz, dtype=cp.float32)
        # The copies run on a non-blocking stream, which does not wait for the current one by itself: without
        # this, the padding's zero fill (or work that last used the pool's memory) could land after them.
        stream.wait_event(cp.cuda.get_current_stream().record())
        slots = [(pinned(widest, np.int32), pinned(widest, np.float32), cp.cuda.Event()) for _ in range(2)]

        def read(k: int) -> tuple[int, int]:
            # block k goes to slot k % 2, whose last copy (block k - 2) was issued before this read
            # was asked for: wait for that copy, then read over it
            (a, b), (idx, val, done) = bounds[k], slots[k % 2]
            done.synchronize()
            got = source.read_rows_into(r0 + a, r0 + b, idx, val)
            if int(got[-1]) != int(ip[b] - ip[a]):
                raise DeviceError(f"rows [{r0 + a}, {r0 + b}): read {int(got[-1])} elements, the row pointer says {int(ip[b] - ip[a])}")
            return int(ip[a]), int(ip[b])

        blocks = enumerate(prefetched(read, range(len(bounds))))
        while True:
            with setup_times.phase("wait_read"):
                k, (lo, hi) = next(blocks, (None, (0, 0)))
            if k is None:
                break
            idx, val, done = slots[k % 2]
            with setup_times.phase("to_gpu"):
                indices[pad + lo : pad + hi].set(idx[: hi - lo], stream)
                data[pad + lo : pad + hi].set(val[: hi - lo], stream)
                done.record(stream)
        with setup_times.phase("to_gpu"):
            indptr = cp.asarray(ip + pad)
            stream.synchronize()
        return DeviceCSR(indptr, indices, data, (r1 - r0, source.shape[1]))


def _indptr_at(source: Any, row: int) -> int:
    """``indptr[row]`` of an opened matrix (one element read where the reader allows it)."""
    ds = getattr(source, "_ds", None)
    if ds is not None and "indptr" in ds:
        return int(ds["indptr"][row])
    return int(source.read_indptr()[row])


def unpadded(a: Any) -> Any:
    """A ``DeviceCSR`` without :func:`rows_to_device`'s alignment padding (a copy when padded)."""
    pad = int(a.indptr[0])
    if pad == 0:
        return a
    return DeviceCSR(a.indptr - pad, a.indices[pad:].copy(), a.data[pad:].copy(), a.shape)


def correlation_epilogue(g: Any, bg: Any = None) -> dict[str, Any]:
    """The row launchers' fused-correlation keywords: ``g / (A f)`` (``MODE_CORR``), or with a background
    ``bg`` (``b' = b / m``) ``g / (A f + bg)`` (``MODE_CORR_BG``)."""
    if bg is None:
        return {"mode": MODE_CORR, "aux0": g}
    return {"mode": MODE_CORR_BG, "aux0": g, "aux1": bg}


def spmv_vectors(shape: tuple[int, int], x: Any, out: Any, mode: int, aux0: Any, aux1: Any) -> Any:
    """Check an SpMV's vectors against ``shape`` (``x``; ``out``, allocated when None; the epilogue's); return ``out``."""
    m, n = shape
    check_vector("x", x, n)
    if out is None:
        out = cupy().empty(m, dtype=cupy().float32)
    else:
        check_vector("out", out, m)
    if mode != MODE_PLAIN:
        check_vector("aux0", aux0, m)
        if mode in (MODE_UPDATE, MODE_CORR_BG):
            check_vector("aux1", aux1, m)
    return out


def _launch_rows(kernel: Any, rows: int, lanes: int, args: tuple, waves: int | None = None) -> None:
    _rows_launch(kernel, rows, lanes, args, waves)()


def _rows_launch(kernel: Any, rows: int, lanes: int, args: tuple, waves: int | None = None) -> Callable[[], None]:
    """The launch of a row kernel over ``rows`` rows, prepared: calling it only submits the kernel."""
    props = device_properties(cupy().cuda.Device().id)
    blocks, threads = plan.launch_shape(
        rows, plan.THREADS // lanes, props["sm_count"], props["max_threads_per_sm"], waves=waves
    )
    return partial(kernel, (blocks,), (threads,), args)


def _prepared(run: Callable[[], Any], out: Any, prepare: bool) -> Any:
    """``run`` now (``out``), or, with ``prepare``, a call that runs it and returns ``out``."""
    if prepare:
        def launch() -> Any:
            run()
            return out
        return launch
    run()
    return out


def _checked_lanes(lanes: int | None, a: DeviceCSR) -> int:
    lanes_ = lanes or a.lanes()
    if lanes_ not in plan.LANE_CHOICES:
        raise ConfigError("lanes", f"lanes per row must be one of {plan.LANE_CHOICES}, got {lanes_}")
    return lanes_


def csr_vector(
    a: DeviceCSR,
    x: Any,
    out: Any = None,
    *,
    lanes: int | None = None,
    mode: int = MODE_PLAIN,
    aux0: Any = None,
    aux1: Any = None,
    shape: plan.RowShape | None = None,
    skip_empty: bool = False,
    prepare: bool = False,
    **_: Any,
) -> Any:
    """``out = A x`` by ``csr_vector`` (``lanes`` lanes per row), with the fused epilogue ``mode``.

    The registry's launcher of ``csr_vector`` (forward, and back on a stored ``A^T``); every row
    launcher takes these arguments (:func:`spmv` documents them) and ignores those of other kernels.

    ``shape`` is the launch shape (:class:`~mlemlib.backends._cuda_plan.RowShape`: threads per
    block, rows in step, grid cap, streaming loads); None takes the matrix's
    :attr:`DeviceCSR.row_shape` (set by :meth:`DeviceCSR.tune`). The default shape runs
    ``csr_vector_L``, one with ``row_bound`` ``csr_row_L``, any other ``csr_block_L``; the sums, and
    so the result, are the same bit for bit. ``skip_empty`` (``mode`` plain or the correlation):
    where :meth:`DeviceCSR.compact_rows` lists the non-empty rows, only they are computed and
    ``out``'s entries at empty rows are left as they are; the caller keeps them at 0, what both
    epilogues write there. ``prepare``: check the vectors, resolve lanes and shape and build the
    arguments now, and return a call that only submits the kernel (and returns ``out``).
    """
    cp = cupy()
    m, n = a.shape
    out = spmv_vectors(a.shape, x, out, mode, aux0, aux1)
    if m == 0:
        return (lambda: out) if prepare else out
    if skip_empty and mode == MODE_UPDATE:
        raise ValueError("skip_empty: an empty row's update is not 0 (f * 0 / norm keeps f's sign and NaN)")
    rows = a.launch_rows(skip_empty)
    if rows is not None:
        m = int(rows.size)
    args = (a.indptr, a.indices, a.data, x, out, np.int64(m), np.int32(mode),
            aux0 if aux0 is not None else out, aux1 if aux1 is not None else out,
            np.uint64(0) if rows is None else rows)  # 0: the kernels' null row list
    lanes_ = _checked_lanes(lanes, a)
    if shape is None:  # the matrix's tuned shape, where this lane count can take it
        shape = a.row_shape if lanes_ in plan.BLOCK_LANES else None
    if shape is None or shape.is_default:
        return _prepared(_rows_launch(function(SPMV, f"csr_vector_{lanes_}"), m, lanes_, args), out, prepare)
    if lanes_ not in plan.BLOCK_LANES:
        raise ConfigError("lanes", f"a block shape needs lanes in {plan.BLOCK_LANES}, got {lanes_}")
    if shape.row_bound and a.stats()["max_row_length"] > plan.ROW_KERNEL_MAX_LENGTH:
        raise ConfigError("shape", f"shape {shape.label()} takes rows of at most "
                                   f"{plan.ROW_KERNEL_MAX_LENGTH} non-zeros; this matrix has one of "
                                   f"{a.stats()['max_row_length']}")
    fn = function(shape.build, f"{shape.kernel}_{lanes_}")
    if shape.row_bound:  # csr_row_L: one row per group, no loop
        run = partial(fn, (max(1, -(-m // (shape.threads // lanes_))),), (shape.threads,), args)
    else:  # csr_block_L
        props = device_properties(cp.cuda.Device().id)
        blocks, threads = plan.launch_shape(
            m, shape.threads // lanes_, props["sm_count"], props["max_threads_per_sm"],
            threads=shape.threads, waves=shape.waves,
        )
        run = partial(fn, (blocks,), (threads,), (*args[:-1], np.int32(bool(shape.sync)), args[-1]))
    return _prepared(run, out, prepare)


def csr_scalar(a: DeviceCSR, x: Any, out: Any = None, *, mode: int = MODE_PLAIN, aux0: Any = None,
               aux1: Any = None, prepare: bool = False, **_: Any) -> Any:
    """``out = A x`` by ``csr_scalar`` (one thread per row), with the fused epilogue ``mode`` (as :func:`csr_vector`)."""
    m = a.shape[0]
    out = spmv_vectors(a.shape, x, out, mode, aux0, aux1)
    if m == 0:
        return (lambda: out) if prepare else out
    args = (a.indptr, a.indices, a.data, x, out, np.int64(m), np.int32(mode),
            aux0 if aux0 is not None else out, aux1 if aux1 is not None else out)
    return _prepared(_rows_launch(function(SPMV, "csr_scalar"), m, 1, args), out, prepare)


def _epilogue_after(product: Callable[[Any], None], a: DeviceCSR, x: Any, out: Any, mode: int, aux0: Any,
                    aux1: Any, prepare: bool) -> Any:
    """A product that writes its own output (``product(y)``), then the epilogue ``mode`` as a second kernel."""
    cp = cupy()
    m = a.shape[0]
    out = spmv_vectors(a.shape, x, out, mode, aux0, aux1)

    def run() -> None:
        if m == 0:
            return
        # the product must not overwrite the epilogue's input
        y = cp.empty(m, dtype=cp.float32) if mode != MODE_PLAIN and out is aux0 else out
        product(y)
        if mode == MODE_CORR:
            correlate(aux0, y, out=out)
        elif mode == MODE_CORR_BG:
            correlate(aux0, y, out=out, bg=aux1)
        elif mode == MODE_UPDATE:
            update(aux0, y, aux1, out=out)

    return _prepared(run, out, prepare)


def merge(a: DeviceCSR, x: Any, out: Any = None, *, mode: int = MODE_PLAIN, aux0: Any = None, aux1: Any = None,
          secsize: int = plan.DEFAULT_SECSIZE, prepare: bool = False, **_: Any) -> Any:
    """``out = A x`` by the merge-path ``merge_spmv`` (``secsize`` merge items per thread, atomics), then ``mode``'s epilogue."""
    def product(y: Any) -> None:
        y.fill(0)
        if a.nnz:
            props = device_properties(cupy().cuda.Device().id)
            nthreads = plan.merge_threads(a.shape[0], a.nnz, secsize)
            blocks, threads = plan.launch_shape(nthreads, plan.THREADS, props["sm_count"], props["max_threads_per_sm"])
            function(SPMV, "merge_spmv")(
                (blocks,), (threads,),
                (a.indptr, a.indices, a.data, x, y, np.int64(a.shape[0]), np.int64(a.nnz), np.int32(secsize)),
            )

    return _epilogue_after(product, a, x, out, mode, aux0, aux1, prepare)


def cusparse(a: DeviceCSR, x: Any, out: Any = None, *, mode: int = MODE_PLAIN, aux0: Any = None, aux1: Any = None,
             prepare: bool = False, **_: Any) -> Any:
    """``out = A x`` by cuSPARSE's SpMV through CuPy (allocates), then ``mode``'s epilogue."""
    def product(y: Any) -> None:
        if a.nnz:
            y[...] = a.cusparse() @ x
        else:
            y.fill(0)

    return _epilogue_after(product, a, x, out, mode, aux0, aux1, prepare)


def spmv(a: DeviceCSR, x: Any, out: Any = None, *, kernel: str = "csr_vector", **kw: Any) -> Any:
    """``y = A x`` by the row kernel named ``kernel`` (its registry launcher), optionally with a fused epilogue.

    Parameters
    ----------
    a
        The matrix (m x n).
    x
        float32 vector of length n.
    out
        float32 vector of length m to write (allocated when None). With
        ``mode=MODE_UPDATE`` it may be ``aux0`` itself (in-place update).
    kernel
        ``csr_vector``, ``csr_scalar``, ``merge`` or ``cusparse``.
    **kw
        The launchers' arguments: ``lanes`` (lanes per row of ``csr_vector``, default from the mean
        row length); ``mode`` (:data:`MODE_PLAIN`; :data:`MODE_CORR`: out = aux0 / (A x), 0 where
        A x is 0; :data:`MODE_UPDATE`: out = aux0 * (A x) / aux1, aux0 * (A x) where aux1 is 0;
        ``merge`` and ``cusparse`` apply it as a second, elementwise kernel), ``aux0``, ``aux1``;
        ``secsize`` (``merge``); ``shape`` (``csr_vector``, :func:`csr_vector`).

    Returns
    -------
    cupy.ndarray
        ``out``.
    """
    from mlemlib import registry

    return registry.launcher(registry.get("cuda", "forward", registry.check("fp", kernel, "cuda", fmt="csr")))(
        a, x, out, **kw)


@dataclass
class SmemPlan:
    """Set-up of ``scatter_smem`` for one matrix: row chunks and their column windows."""

    chunk_rows: Any  # cupy int64 [nchunks + 1]
    cmin: Any  # cupy int32 [nchunks]
    cmax: Any
    window: int  # floats of shared memory per block
    local_fraction: float  # share of chunks whose columns fit the window


def smem_plan(a: DeviceCSR, *, chunk_nnz: int = SMEM_CHUNK_NNZ) -> SmemPlan:
    """Plan ``scatter_smem``: nnz-balanced row chunks and each chunk's column window (set-up phase ``plan``)."""
    with setup_times.phase("plan", device=True):
        return _smem_plan(a, chunk_nnz)


def _smem_plan(a: DeviceCSR, chunk_nnz: int) -> SmemPlan:
    cp = cupy()
    props = device_properties(cp.cuda.Device().id)
    bounds = plan.chunk_rows(a.indptr.get(), chunk_nnz)
    nchunks = len(bounds) - 1
    crow = cp.asarray(bounds)
    cmin = cp.empty(max(nchunks, 1), dtype=cp.int32)
    cmax = cp.empty(max(nchunks, 1), dtype=cp.int32)
    if nchunks:
        function(SPMV, "chunk_bounds")((nchunks,), (256,), (a.indptr, a.indices, crow, cmin, cmax))
    window = props["smem_per_block_optin"] // 4
    width = cmax[:nchunks] - cmin[:nchunks] + 1
    frac = float(((width > 0) & (width <= window)).sum()) / nchunks if nchunks else 1.0
    return SmemPlan(crow, cmin, cmax, int(window), frac)


def _scatter_out(a: DeviceCSR, c: Any, out: Any) -> Any:
    """Check ``c`` (length m) and ``out`` (length n, allocated when None) of ``A^T c``."""
    m, n = a.shape
    check_vector("c", c, m)
    if out is None:
        return cupy().empty(n, dtype=cupy().float32)
    check_vector("out", out, n)
    return out


def _scatter_lanes(build: Build, name: str, a: DeviceCSR, c: Any, out: Any, lanes: int | None, spread: bool) -> Any:
    out = _scatter_out(a, c, out)
    out.fill(0)
    m = a.shape[0]
    if m == 0 or a.nnz == 0:
        return out
    lanes_ = _checked_lanes(lanes, a)
    # one row per lane group, no grid-stride loop; the rows in a spread order (group w takes row
    # w P mod m) unless ``spread`` is off
    stride = plan.spread_stride(m) if spread else 1
    _launch_rows(function(build, f"{name}_{lanes_}"), m, lanes_,
                 (a.indptr, a.indices, a.data, c, out, np.int64(m), np.int64(stride)), waves=0)
    return out


def scatter_atomic(a: DeviceCSR, c: Any, out: Any = None, *, lanes: int | None = None, spread: bool = True,
                   **_: Any) -> Any:
    """``out = A^T c`` by ``scatter_L`` (``lanes`` lanes per row, scalar float atomics: not deterministic).

    ``out`` (length n, allocated when None) is zeroed here. ``spread``: the rows in a spread order
    (rows in flight together then add into voxels far apart); False: in order.
    """
    return _scatter_lanes(SPMV, "scatter", a, c, out, lanes, spread)


def scatter_vec(a: DeviceCSR, c: Any, out: Any = None, *, lanes: int | None = None, spread: bool = True,
                **_: Any) -> Any:
    """``out = A^T c`` by ``scatter_vec_L``: as :func:`scatter_atomic` with 2/4-wide vector atomics over aligned column runs (sm_90)."""
    return _scatter_lanes(SPMV_VECTOR_ATOMICS, "scatter_vec", a, c, out, lanes, spread)


def scatter_smem(a: DeviceCSR, c: Any, out: Any = None, *, smem: SmemPlan | None = None, **_: Any) -> Any:
    """``out = A^T c`` by ``scatter_smem``: per row chunk, atomics into a shared-memory window of its columns.

    ``smem`` is the :func:`smem_plan` of ``a`` (made here when None; make it once).
    """
    out = _scatter_out(a, c, out)
    out.fill(0)
    if a.shape[0] == 0 or a.nnz == 0:
        return out
    sp = smem if smem is not None else smem_plan(a)
    fn = function(SPMV, "scatter_smem")
    shared = sp.window * 4
    fn.max_dynamic_shared_size_bytes = shared
    fn((len(sp.chunk_rows) - 1,), (SMEM_THREADS,),
       (a.indptr, a.indices, a.data, c, out, sp.chunk_rows, sp.cmin, sp.cmax, np.int32(sp.window)),
       shared_mem=shared)
    return out


def cusparse_scatter(a: DeviceCSR, c: Any, out: Any = None, **_: Any) -> Any:
    """``out = A^T c`` by cuSPARSE's transposed product ``A.T @ c`` through CuPy (allocates)."""
    out = _scatter_out(a, c, out)
    if a.nnz:
        out[...] = a.cusparse().T @ c
    else:
        out.fill(0)
    return out


def notrans(a: DeviceCSR, c: Any, out: Any = None, *, smem: SmemPlan | None = None, **kw: Any) -> Any:
    """``out = A^T c`` by the scatter the ``notrans`` selector takes for ``a`` (:func:`mlemlib.registry.choose_notrans`
    of its :func:`smem_plan`). The backends settle the selector once at set-up; this is for a direct call."""
    from mlemlib import registry

    sp = smem if smem is not None else smem_plan(a)
    chosen = registry.get("cuda", "back_notrans", registry.choose_notrans(sp.local_fraction))
    return registry.launcher(chosen)(a, c, out, smem=sp, **kw)


def scatter(a: DeviceCSR, c: Any, out: Any = None, *, kernel: str = "scatter", **kw: Any) -> Any:
    """``out = A^T c`` from the rows of ``A`` (no transpose) by the kernel named ``kernel`` (its registry launcher).

    ``kernel`` is ``scatter``, ``scatter_vec``, ``scatter_smem`` or ``cusparse_notrans``; ``kw`` the
    launcher's arguments (``lanes``, ``spread``, ``smem``). ``out`` is zeroed (or overwritten).
    """
    from mlemlib import registry

    return registry.launcher(registry.get("cuda", "back_notrans", registry.check("bp", kernel, "cuda", fmt="csr")))(
        a, c, out, **kw)


@functools.cache
def _elementwise(which: str) -> Any:
    cp = cupy()
    if which == "correlate":
        return cp.ElementwiseKernel(
            "float32 g, float32 fp", "float32 c", "c = (fp != 0.0f) ? g / fp : 0.0f", "mlem_correlate"
        )
    if which == "correlate_bg":
        return cp.ElementwiseKernel(
            "float32 g, float32 fp, float32 bg", "float32 c", "float d = fp + bg; c = (d != 0.0f) ? g / d : 0.0f",
            "mlem_correlate_bg"
        )
    if which == "update_fixed":  # bp from the fixed point as fixed_to_float rounds it, then the update
        return cp.ElementwiseKernel(
            "float32 f, uint64 acc, float64 inv_scale, float32 norm",
            "float32 out",
            "float bp = (float)((double)acc * inv_scale); "
            "out = (norm != 0.0f) ? (norm == norm ? f * bp / norm : f) : f * bp",
            "mlem_update_fixed",
        )
    return cp.ElementwiseKernel(
        "float32 f, float32 bp, float32 norm",
        "float32 out",
        "out = (norm != 0.0f) ? (norm == norm ? f * bp / norm : f) : f * bp",
        "mlem_update",
    )


def correlate(g: Any, fp: Any, out: Any = None, bg: Any = None) -> Any:
    """``c = g / fp`` (0 where ``fp == 0``), one fused elementwise kernel; ``out`` may be ``fp``.

    With ``bg`` (the background per unit of sensitivity, ``b / m``; +inf at a gap): ``c = g / (fp + bg)``,
    0 where that is 0.
    """
    args = (g, fp) if bg is None else (g, fp, bg)
    kernel = _elementwise("correlate" if bg is None else "correlate_bg")
    return kernel(*args) if out is None else kernel(*args, out)


def update(f: Any, bp: Any, norm: Any, out: Any = None) -> Any:
    """``f * bp / norm`` (``f * bp`` where ``norm == 0``; ``f`` where ``norm`` is NaN: an OSEM subset
    that does not see the voxel keeps it); ``out`` may be ``f`` or ``bp``."""
    if out is None:
        return _elementwise("update")(f, bp, norm)
    return _elementwise("update")(f, bp, norm, out)


def update_fixed(f: Any, acc: Any, scale: float, norm: Any, out: Any = None) -> Any:
    """:func:`update` with ``bp`` the deterministic kernels' 64-bit fixed point ``acc`` at ``scale``, in one
    kernel: ``bp = acc / scale`` rounded to float32 as ``fixed_to_float`` writes it, so the image is the
    same bits as ``fixed_to_float`` then :func:`update`; ``out`` may be ``f``."""
    inv = np.float64(1.0 / scale)
    if out is None:
        return _elementwise("update_fixed")(f, acc, inv, norm)
    return _elementwise("update_fixed")(f, acc, inv, norm, out)
