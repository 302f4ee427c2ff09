"""The one-GPU CUDA backend of the MLEM loop (CuPy RawKernels; CUDA only, CuPy imported lazily).

Kernels (``fp=`` / ``bp=``; see docs/gpu.md for when to pick which):

- forward projection: ``csr_vector`` (default; 2..32 lanes per row, 16-byte
  loads, warp-shuffle sums, deterministic), ``csr_scalar`` (one thread per
  row), ``merge`` (thesis 5.1, ``secsize`` items per thread, atomics: not
  deterministic), ``cusparse`` (CuPy's ``A @ f``);
- back projection on the stored transpose ``A^T``: ``csr_vector``,
  ``csr_scalar``, ``merge``, ``cusparse`` (``A_T @ c``);
- back projection without a transpose (thesis ch. 7), atomics, not
  deterministic: ``scatter`` (the thesis's kernel, lanes per row),
  ``scatter_vec`` (vector atomics), ``scatter_smem`` (shared-memory windows
  per row chunk), ``cusparse_notrans`` (CuPy's ``A.T @ c``), and ``notrans``:
  ``scatter_smem`` where most row chunks fit shared memory, else
  ``scatter`` (:func:`mlemlib.registry.choose_notrans`);
- ``bp="auto"``: ``onepass_chunked`` (the whole iteration, deterministic)
  where a sample of the matrix's row chunks reuses voxels (a matrix in the
  reorder stage's order; :func:`mlemlib.registry.choose_auto`, the rule of every GPU
  count), else
  ``csr_vector`` on the transpose when one is given, or when ``A`` is CSR
  with at most 2^31 - 1 non-zeros (transposed on the GPU with cuSPARSE), and
  ``A`` and ``A^T`` both fit in free GPU memory, else ``notrans`` (logged).

With ``fuse=True`` (the default) the correlation runs in the epilogue of a
``csr_vector``/``csr_scalar`` forward projection and the update in the
epilogue of a ``csr_vector``/``csr_scalar`` back projection on the transpose,
so an iteration is two kernels; the images are bit-identical to the unfused
steps. Step times come from CUDA events recorded around each step; the device
is synchronised only when :meth:`CudaBackend.last_step_times` is read. Fused
steps are reported under the kernel they ran in (``fp`` includes ``corr``,
``bp`` includes ``update``), with ``iteration`` the whole.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any, NamedTuple

import numpy as np

from mlemlib import registry, setup_times
from mlemlib.backends import _cuda_kernels as ck
from mlemlib.backends import _cuda_plan as plan
from mlemlib.backends._tune_cache import TuneCache, source_key
from mlemlib.backends.base import (
    FIXED_RETRIES,
    FIXED_RETRY_FACTOR,
    ONEPASS_C_MAX,
    STEPS,
    Backend,
    bytes_per_nnz,
    calibrated_bound,
    no_stored_transpose,
)
from mlemlib.backends.device_formats import DeviceMatrix, device_type
from mlemlib.errors import ConfigError, DeviceError
from mlemlib.formats.spec import matrix_format_of
from mlemlib.matrix import shape_nnz

log = logging.getLogger(__name__)

#: Share of the free GPU memory the matrices may take (the rest: vectors, cuSPARSE workspace).
MEMORY_HEADROOM = 0.92
GIB = float(1 << 30)


def sample_chunks(matrix: Any, device_id: int) -> tuple[float, float] | None:
    """``(reuse, chunks)`` of a sample of ``matrix``'s row chunks at ``device_id``'s window
    (:func:`mlemlib.chunked.sample_chunks`): what :func:`mlemlib.registry.choose_auto` decides from."""
    from mlemlib import chunked

    with setup_times.phase("sample"):
        return chunked.sample_chunks(matrix, cc().chunk_window(device_id))


def chunk_layout(chunks: Any, matrix: Any) -> tuple[Any, bool]:
    """``(layout, opened here)`` of a backend's ``chunks=``: a layout file's path opened, or a
    :class:`mlemlib.chunked.ChunkLayout` as given, checked against ``matrix``; ``(None, False)`` for None.

    Raises
    ------
    MatrixFormatError
        A layout file that is damaged or made from another matrix (one line naming it).
    """
    from mlemlib import chunked

    if chunks is None:
        return None, False
    if isinstance(chunks, chunked.ChunkLayout):
        chunks.check_source(matrix)
        return chunks, False
    return chunked.open_layout(chunks, source=matrix), True


def free_memory(device_id: int) -> int:
    """Bytes free on a GPU, counting what CuPy's pool holds but does not use (set-up phase ``init``: the
    first call creates the device's CUDA context)."""
    cp = ck.cupy()
    with setup_times.phase("init"), cp.cuda.Device(device_id):
        free, _total = cp.cuda.runtime.memGetInfo()
        return int(free + cp.get_default_memory_pool().free_bytes())


class _MemoryNeed(NamedTuple):
    """What a backend's set-up found free on its GPU and what its matrices and vectors need (bytes)."""

    free: int
    a: int
    t: int
    vec: int
    fits_both: bool


def _check_transpose(transpose: Any | None, m: int, n: int, nnz: int) -> None:
    """Refuse a given transpose whose shape or number of non-zeros is not that of ``A`` (m x n) transposed."""
    if transpose is not None:
        t_shape, t_nnz = shape_nnz(transpose)
        if t_shape != (n, m) or t_nnz != nnz:
            raise ConfigError("transpose", f"transpose is {t_shape} with {t_nnz} nnz, expected {(n, m)} with {nnz}")


class CudaBackend(Backend):
    """MLEM on one GPU.

    Parameters
    ----------
    matrix
        ``A`` (m x n): :class:`CSRMatrix`, an opened matrix (streamed to the
        GPU), a SciPy sparse matrix, or a ``DeviceCSR`` already on the GPU.
    g
        Measurement, length m (counts or floats; float32 on the GPU).
    norm
        Column sums of ``A``, length n (float64 recommended; its sum, used
        for the initial image, is taken in float64).
    transpose
        ``A^T`` (n x m) in any of the forms of ``matrix``, or None. Without
        one, a back-projection kernel that needs it computes it on the GPU
        with cuSPARSE when it fits.
    fp, bp
        Kernel names (module docstring); ``auto`` resolves as documented.
    secsize
        Section size of ``merge`` (None: :data:`~mlemlib.backends._cuda_plan.DEFAULT_SECSIZE`).
    device
        CUDA device index.
    lanes
        Lanes per row of ``csr_vector``/``scatter`` (None: from the mean row length).
    fuse
        Fuse the correlation and the update into the projections where the
        kernels allow.
    tune
        Time ``csr_vector``'s launch shapes on ``A`` and ``A^T`` at set-up and
        keep the fastest (:meth:`~mlemlib.backends._cuda_kernels.DeviceCSR.tune`;
        a shape never changes a result). False: csr_vector_L's own shape.
    chunks
        The row chunks of ``matrix`` as a layout file (``mlem chunk``; a
        path or an opened :class:`mlemlib.chunked.ChunkLayout`), checked
        against ``matrix``: a kernel that reads chunks (``onepass_chunked``)
        loads it instead of chunking the matrix here, and ``bp=auto`` decides
        from its exact reuse and chunk count instead of a sample.
    background
        None, or ``b' = b / m`` per row (:mod:`mlemlib.backends.base`): the correlation is
        ``g / (A f + b')`` in every kernel (fused epilogue, elementwise, one passes).
    subsets
        None or ``[0, m]`` (one subset); OSEM with S > 1 runs through
        :class:`mlemlib.backends.osem.OsemBackend` (``make_backend`` takes it).
    tune_cache
        A directory that keeps ``tune``'s launch shapes per matrix file, row
        block and device (:mod:`mlemlib.backends._tune_cache`); None: the
        environment's ``MLEM_TUNE_CACHE``, and no cache where that is unset.

    The set-up is recorded per phase (:mod:`mlemlib.setup_times`):
    ``describe()["setup"]`` and one log line where it ends.

    Raises
    ------
    DeviceError
        No CuPy/GPU, or the matrices do not fit in free GPU memory.
    ConfigError
        Unknown kernel, bad ``secsize``, norm of the wrong length.
    SinogramFormatError
        Measurement of the wrong length.
    """

    name = "cuda"

    @setup_times.records
    def __init__(
        self,
        matrix: Any,
        g: Any,
        norm: Any,
        transpose: Any | None = None,
        *,
        fp: str = "auto",
        bp: str = "auto",
        secsize: int | None = None,
        device: int = 0,
        lanes: int | None = None,
        fuse: bool = True,
        tune: bool = True,
        chunks: Any | None = None,
        background: Any | None = None,
        subsets: Any | None = None,
        tune_cache: Any | None = None,
    ) -> None:
        super().__init__()
        free = self._open_device(device)
        self._take_launch_options(secsize, lanes)

        (m, n), nnz = shape_nnz(matrix)
        self.shape = (m, n)
        self.matrix_format = matrix_format_of(matrix)
        self.format = self.matrix_format.name
        dev_type = device_type(self.format)
        _check_transpose(transpose, m, n, nnz)

        layout, own_layout = chunk_layout(chunks, matrix)
        with self._device, contextlib.closing(layout) if own_layout else contextlib.nullcontext():
            need = self._measure_memory(matrix, transpose, bp, layout, dev_type, free, m, n, nnz)
            choice = self._decide_kernels(matrix, transpose, fp, bp, layout, need, nnz)
            paired = self._take_choice(choice, bp, layout)
            self._prefetch_kernels(tune)
            choice = self._upload_matrix(matrix, bp, layout, dev_type, choice, paired)
            self._plan_shared_memory(choice)
            self._place_transpose(transpose, dev_type, choice)
            norm = self._upload_problem(g, norm, background, subsets, m, n)
            self._allocate_buffers(norm, fuse, m, n, nnz)
            self._keep_in_l2()
            self._tune_launches(matrix, transpose, tune, tune_cache)
            self._warm_up()
        log.info(
            "cuda backend on GPU %d: fp=%s bp=%s (%s transpose), lanes fp=%s, fused fp+corr=%s, bp+update=%s",
            self.device_id,
            self.fp_kernel,
            self.bp_kernel,
            self.transpose_source,
            self._lanes(self.a),
            self.fuse_fp,
            self.fuse_bp,
        )

    # --- set-up steps, in the constructor's order ----------------------------------
    def _open_device(self, device: int) -> int:
        """Check that GPU ``device`` is visible and usable, and keep it; the bytes free on it."""
        with setup_times.phase("init"):
            cp = ck.cupy()
            try:
                ndev = cp.cuda.runtime.getDeviceCount()
            except Exception as exc:
                raise DeviceError(f"no CUDA GPU usable: {exc}") from exc
            if not 0 <= int(device) < ndev:
                raise DeviceError(f"GPU {device} requested, {ndev} visible")
            self.device_id = int(device)
            self._device = cp.cuda.Device(self.device_id)
            free = free_memory(self.device_id)  # the first call on the device: its CUDA context is made here
        return free

    def _take_launch_options(self, secsize: int | None, lanes: int | None) -> None:
        """Check and keep ``merge``'s section size and the lanes per row given (None: from the rows)."""
        self.secsize = plan.DEFAULT_SECSIZE if secsize is None else int(secsize)
        if self.secsize < 1:
            raise ConfigError("secsize", f"section size must be >= 1, got {secsize}")
        if lanes is not None and lanes not in plan.LANE_CHOICES:
            raise ConfigError("lanes", f"lanes per row must be one of {plan.LANE_CHOICES}, got {lanes}")
        self.lanes_override = lanes

    def _measure_memory(self, matrix: Any, transpose: Any | None, bp: str, layout: Any, dev_type: Any, free: int,
                        m: int, n: int, nnz: int) -> _MemoryNeed:
        """What ``A``, ``A^T`` and the vectors need on the GPU (``memory``); DeviceError where ``A`` does not fit."""
        # a DeviceCSR already on the GPU needs nothing more; the chunked one pass holds its own copy
        self.chunked = bp not in ("auto", None) and registry.get_bp("cuda", str(bp)).chunks
        if self.chunked:
            need_a = layout.device_bytes() if layout is not None else cc().DeviceChunked.device_bytes(matrix)
        else:
            need_a = 0 if isinstance(matrix, DeviceMatrix) else dev_type.device_bytes(matrix)
        if transpose is None:  # transposed on the GPU: about A's size, and cuSPARSE's work space
            need_t = need_a + 4 * nnz
        else:
            need_t = 0 if isinstance(transpose, DeviceMatrix) else dev_type.device_bytes(transpose)
        need_vec = 4 * (3 * m + 4 * n)
        fits_a = need_a + need_vec <= MEMORY_HEADROOM * free
        fits_both = need_a + need_t + need_vec <= MEMORY_HEADROOM * free
        self.memory = {"free_before": free, "matrix": need_a, "transpose": need_t, "vectors": need_vec}
        if not fits_a:
            raise DeviceError(
                f"GPU {self.device_id}: A needs {need_a / GIB:.2f} GiB but only {free / GIB:.2f} GiB are free; "
                "use more GPUs"
            )
        return _MemoryNeed(free, need_a, need_t, need_vec, fits_both)

    def _decide_kernels(self, matrix: Any, transpose: Any | None, fp: str, bp: str, layout: Any, need: _MemoryNeed,
                        nnz: int) -> Any:
        """The kernels for this matrix and memory (:func:`mlemlib.registry.decide`); why ``bp=auto`` chose, logged."""
        free, need_a, need_t, need_vec, fits_both = need
        # A CSR matrix without a stored transpose is transposed here (cuSPARSE, 32-bit indices): faster
        # than reading A^T from disk
        on_gpu_t = transpose is None and self.matrix_format.cusparse and nnz <= registry.CUSPARSE_MAX_NNZ
        def chunks_fit() -> bool:
            need_c = layout.device_bytes() if layout is not None else cc().DeviceChunked.device_bytes(matrix)
            if need_c + need_vec > MEMORY_HEADROOM * free:
                log.info("bp=auto: the row chunks (%.2f GiB) do not fit the %.2f GiB free", need_c / GIB,
                         free / GIB)
                return False
            self.memory["matrix"], self.memory["transpose"] = need_c, 0
            return True

        # the chunked one pass where a sample of the matrix's chunks reuses voxels (a reordered matrix)
        may_sample = not self.matrix_format.compressed or not isinstance(matrix, DeviceMatrix)
        choice = registry.decide(
            "cuda", fp, bp, transpose_available=transpose is not None or on_gpu_t, fits=fits_both,
            fmt=self.format, sms=ck.device_properties(self.device_id)["sm_count"], chunks_fit=chunks_fit,
            sample=(lambda: (layout.reuse, layout.chunks) if layout is not None
                    else sample_chunks(matrix, self.device_id)) if may_sample else None,
        )
        if bp in ("auto", None):
            if transpose is None and not on_gpu_t:
                log.info("bp=auto: no transpose given (and none made on the GPU for a %s matrix of %d "
                         "non-zeros), back projection without a transpose", self.format, nnz)
            elif not fits_both:
                log.warning(
                    "bp=auto: A (%.2f GiB) and A^T (%.2f GiB) do not both fit in the %.2f GiB free on GPU %d: "
                    "back projection by scatter, without the transpose",
                    need_a / GIB,
                    need_t / GIB,
                    free / GIB,
                    self.device_id,
                )
        if choice.needs_transpose and not fits_both:
            raise DeviceError(
                f"GPU {self.device_id}: A ({need_a / GIB:.2f} GiB) and A^T ({need_t / GIB:.2f} GiB) do not both "
                f"fit in the {free / GIB:.2f} GiB free; use bp=notrans (scatter) or more GPUs"
            )
        return choice

    def _take_choice(self, choice: Any, bp: str, layout: Any) -> Any:
        """Keep the choice's kernels and chunk facts; the choice to fall back on where the chunks cannot be made."""
        self.fp_kernel, self.bp_kernel = choice.fp, choice.bp
        self.bp_requested = str(bp)
        self.deterministic = choice.deterministic
        self.chunk_reuse_sample, self.chunk_estimate = choice.reuse, choice.chunks
        self.chunked = choice.chunked
        paired = choice.paired or choice
        if choice.chunked:
            log.info("bp=auto: %s reuse each voxel %.1f times (%.0f chunks): %s%s",
                     "the layout's chunks" if layout is not None else "chunks of a sample",
                     choice.reuse, choice.chunks, choice.bp,
                     " (the transpose is not read)" if paired.needs_transpose else "")
        self.chunk_file = layout.path if self.chunked and layout is not None else None
        return paired

    def _prefetch_kernels(self, tune: bool) -> None:
        """Start compiling the kernels in the background, while ``A`` is read and copied."""
        ck.prefetch_kernels(registry.kernels_of("cuda", self.fp_kernel, self.bp_kernel), self.device_id,
                            tune=tune and not self.matrix_format.compressed)
        ck.prefetch_kernels([registry.row_forward(self.format)], self.device_id, tune=False)

    def _upload_matrix(self, matrix: Any, bp: str, layout: Any, dev_type: Any, choice: Any, paired: Any) -> Any:
        """Upload ``A`` as its kernels read it (row chunks, or its format); the choice (``paired`` if chunks failed)."""
        if self.chunk_file:
            self.a = cc().DeviceChunked.from_layout(layout)
        elif self.chunked:
            try:
                self.a = cc().DeviceChunked.upload(matrix, what="matrix",
                                                   sms=ck.device_properties(self.device_id)["sm_count"])
            except ValueError as exc:
                if bp not in ("auto", None):
                    raise ConfigError("bp", f"bp={bp}: {exc}; use bp=onepass_fixed") from exc
                log.info("bp=auto: %s; back projection by %s instead of onepass_chunked", exc, paired.bp)
                self.chunked = False
                choice = paired
                self.fp_kernel, self.bp_kernel, self.deterministic = choice.fp, choice.bp, choice.deterministic
        if not self.chunked:
            self.a = dev_type.upload(matrix, what="matrix", fmt=self.format)
        return choice

    def _plan_shared_memory(self, choice: Any) -> None:
        """The shared-memory plan of a back projection that uses one, and the ``notrans`` selector's kernel."""
        self._smem = None
        self.smem_local_fraction: float | None = None
        if registry.get_bp("cuda", self.bp_kernel).smem:
            self._smem = ck.smem_plan(self.a)
            self.smem_local_fraction = self._smem.local_fraction
        if registry.get_bp("cuda", self.bp_kernel).selector:
            self.bp_kernel = registry.choose_notrans(self._smem.local_fraction)
            self.deterministic = choice.settle(self.bp_kernel).deterministic
            log.info(
                "bp=notrans: %.0f%% of the row chunks fit shared memory: %s",
                100 * self._smem.local_fraction,
                self.bp_kernel,
            )
            if not registry.get_bp("cuda", self.bp_kernel).smem:
                self._smem = None

    def _place_transpose(self, transpose: Any | None, dev_type: Any, choice: Any) -> None:
        """``A^T`` on the GPU where the kernels read it: the stored one uploaded, else A transposed by cuSPARSE."""
        cp = ck.cupy()
        self.at = None
        self.transpose_source = "none"
        if choice.needs_transpose:
            if transpose is not None:
                t_fmt = dev_type.transpose_format(transpose, self.format)
                self.at = dev_type.upload(transpose, what="transpose", fmt=t_fmt)
                self.transpose_source = "stored" if t_fmt == matrix_format_of(transpose).name else f"stored, as {t_fmt}"
            elif not self.matrix_format.cusparse:
                raise no_stored_transpose(self.bp_kernel, self.format)
            else:
                log.info("no transpose given: transposing A on GPU %d with cuSPARSE", self.device_id)
                try:
                    self.at = self.a.transpose()
                except cp.cuda.memory.OutOfMemoryError as exc:
                    raise DeviceError(
                        f"GPU {self.device_id}: out of memory transposing A with cuSPARSE ({exc}); "
                        "give a stored transpose or use bp=notrans"
                    ) from exc
                self.transpose_source = "cusparse on device"

    def _upload_problem(self, g: Any, norm: Any, background: Any | None, subsets: Any | None, m: int, n: int) -> Any:
        """Check the measurement, norm, subsets and background, and copy them to the GPU; the norm on the host."""
        cp = ck.cupy()
        g, norm, bg = self._check_one_subset(g, norm, subsets, background, (m, n))
        with setup_times.phase("to_gpu", device=True):
            self.g = cp.asarray(g, dtype=cp.float32)
            self.bg = None if bg is None else cp.asarray(bg)
            self.norm = cp.asarray(norm, dtype=cp.float32)
        return norm

    def _allocate_buffers(self, norm: Any, fuse: bool, m: int, n: int, nnz: int) -> None:
        """The iteration's vectors and kernels, what fuses, its event sets and the one pass's fixed-point state."""
        cp = ck.cupy()
        self._fp = cp.empty(m, dtype=cp.float32)
        # zeros: the correlation of an empty row, which the fused forward leaves unwritten (skip_empty)
        self._c = cp.zeros(m, dtype=cp.float32)
        self._bp = cp.empty(n, dtype=cp.float32)
        self._kb = registry.get_bp("cuda", self.bp_kernel)
        self.onepass = self._kb.op == "iteration"
        self._kf = None if self.onepass else registry.get("cuda", "forward", self.fp_kernel)
        # the forward projection alone (forward()): a one pass's is its format's row kernel
        self._k_forward = self._kf or registry.row_forward(self.format)
        self.fuse_fp = fuse and self._kf is not None and self._kf.fused
        self.fuse_bp = fuse and self.at is not None and self._kb.fused
        self._fixed_bound = (ONEPASS_C_MAX * float(np.nanmax(norm))) if norm.size else 1.0
        self.fixed_stats: dict[str, Any] = {}
        # the events of the last iteration and of the one before (previous_step_times): two sets,
        # so that the last can be recorded while the host reads the one before
        self._events: dict[str, Any] = {}
        self._event_order: list[str] = []
        self._prev_events: dict[str, Any] = {}
        self._prev_order: list[str] = []
        # the fixed point's 64-bit sums (the chunked and the fixed-point one pass)
        self._acc = cp.empty(n, dtype=cp.uint64) if self.onepass and self.deterministic else None
        self._lanes_onepass = cc().onepass_lanes(m, nnz, self.format)  # as on N GPUs
        self._flag = cp.zeros(1, dtype=cp.int32) if self.onepass and self.deterministic else None
        # the fixed-point kernel's add limits, from the matrix's longest column (one count pass, here)
        self._limits = (cc().fixed_limits(cc().column_count_max(self.a))
                        if self._kb.limits else None)
        self._images: list[Any] | None = None  # the one pass's two image buffers

    def _keep_in_l2(self) -> None:
        """Keep the one pass's atomic target in L2 on a stream of its own (a compressed ``A``, where the GPU can)."""
        cp = ck.cupy()
        # The one pass on a compressed A: its atomic target (bp, or the fixed point's accumulator) kept
        # in L2 by a persisting access-policy window on the iteration's own stream (blocking: ordered
        # with the default stream's work); no stream where the GPU has no such control.
        self._stream: Any = None
        self.l2_window: dict | None = None
        if self.onepass and not self.chunked and self.matrix_format.compressed:
            stream = cp.cuda.Stream()
            self.l2_window = cc().persist_in_l2(stream, self._acc if self.deterministic else self._bp)
            self._stream = stream if self.l2_window else None
            if self.l2_window:  # the set-aside and its lines go with the backend (later work gets all of L2)
                weakref.finalize(self, _release_l2_on, self.device_id).atexit = False

    def _tune_launches(self, matrix: Any, transpose: Any | None, tune: bool, tune_cache: Any | None) -> None:
        """Lay out a CSR ``A`` and ``A^T`` for their kernels' lanes, and time their launch shapes where ``tune``."""
        if isinstance(self.a, ck.DeviceCSR):
            ck.set_row_layouts(self.a, self.at, self._kf is not None and self._kf.interleaved,
                               self._kb.interleaved, self._lanes(self.a),
                               self._lanes(self.at) if self.at is not None else 0)
        cache = TuneCache.from_setting(tune_cache) if tune else None
        if tune and self._kf is not None and self._kf.shapes and isinstance(self.a, ck.DeviceCSR):
            self.a.tune(self._lanes(self.a), cache=cache, cache_key=source_key(matrix, "A"))
        if tune and self.at is not None and self._kb.shapes:
            self.at.tune(self._lanes(self.at), cache=cache, cache_key=(
                source_key(transpose, "AT") if transpose is not None
                else source_key(matrix, "AT (transposed on the GPU)")))

    # --- helpers -------------------------------------------------------------------
    def _lanes(self, a: Any) -> int:
        if not isinstance(a, ck.DeviceCSR):
            return a.lanes()
        if self.lanes_override:
            return self.lanes_override
        return ck.transpose_lanes(a) if a is self.at else a.lanes()

    def _warm_up(self) -> None:
        """Compile the kernels and create cuSPARSE handles now, not in the first timed iteration (set-up phase
        ``warm_up``; the kernels' compilation is its own phase)."""
        with setup_times.phase("warm_up", device=True):
            f = self.initial_image()
            self.iterate(f)
            self.synchronize()
            if self.onepass and self.deterministic:  # the range from what the pass summed, as on N GPUs
                top = int(ck.cupy().max(self._acc).get()) if self._acc.size else 0
                self._fixed_bound = calibrated_bound(top, self.fixed_stats.get("scale", 0.0), self._fixed_bound)
        self._events, self._prev_events = {}, {}
        self._event_order, self._prev_order = [], []
        self._times = {}

    def _record(self, name: str) -> None:
        cp = ck.cupy()
        ev = self._events.get(name)
        if ev is None:
            ev = self._events[name] = cp.cuda.Event()
        ev.record()
        self._event_order.append(name)

    # --- the four steps ----------------------------------------------------------
    def _project(self, mat: Any, x: Any, out: Any, k: registry.Kernel, **kw: Any) -> Any:
        """``out = mat x`` (with ``kw``'s epilogue) by the row kernel ``k`` (its registry launcher)."""
        return registry.launcher(k)(mat, x, out, lanes=self._lanes(mat), secsize=self.secsize, **kw)

    def _fused_fp_launch(self, f: Any) -> Any:
        """The forward projection with the correlation fused, prepared (its launcher's ``prepare``); None
        for a matrix of another format than CSR (the call then goes through :meth:`_project`). Where more
        than 1/8 of A's rows are empty (:meth:`DeviceCSR.compact_rows`) only the others are computed:
        ``_c`` keeps its zeros there, the correlation of an empty row."""
        if not isinstance(self.a, ck.DeviceCSR):
            return None
        return registry.launcher(self._kf)(self.a, f, self._c, lanes=self._lanes(self.a), secsize=self.secsize,
                                           skip_empty=True, prepare=True,
                                           **ck.correlation_epilogue(self.g, self.bg))

    def forward(self, f: Any) -> Any:
        with self._device:
            if self.chunked:
                return cc().chunked_forward(self.a, f, self._fp)
            return self._project(self.a, f, self._fp, self._k_forward)

    def correlate(self, fp: Any) -> Any:
        with self._device:
            return ck.correlate(self.g, fp, out=self._c, bg=self.bg)

    def back(self, c: Any) -> Any:
        with self._device:
            if self.onepass:
                raise ConfigError("bp", f"bp={self.bp_kernel} runs whole iterations (iterate), not a back projection")
            if self.at is not None:
                return self._project(self.at, c, self._bp, self._kb)
            return registry.launcher(self._kb)(self.a, c, self._bp, lanes=self._lanes(self.a), smem=self._smem)

    def update(self, f: Any, bp: Any, out: Any = None) -> Any:
        """``f * bp / norm`` into ``out`` (default ``f`` itself)."""
        with self._device:
            return ck.update(f, bp, self.norm, out=f if out is None else out)

    def iterate(self, f: Any) -> Any:
        """One MLEM iteration (two kernels when both sides are fused); times from CUDA events."""
        with self._device, self._stream if self._stream is not None else contextlib.nullcontext():
            self._times = {}
            self._events, self._prev_events = self._prev_events, self._events
            self._event_order, self._prev_order = [], self._event_order
            # the fused forward's launch is prepared (vectors checked, shape resolved) before the first
            # event: after a synchronised iteration the GPU would idle through that host work inside
            # the timed window
            first = self._fused_fp_launch(f) if self.fuse_fp and not self.onepass else None
            self._record("start")
            if self.onepass:  # forward, correlation and back projection in one pass over A
                return self._onepass_iteration(f)
            if self.fuse_fp:
                if first is not None:
                    c = first()
                else:
                    c = self._project(self.a, f, self._c, self._kf, **ck.correlation_epilogue(self.g, self.bg))
                self._record("fp")
            else:
                fp = self.forward(f)
                self._record("fp")
                c = self.correlate(fp)
                self._record("corr")
            if self.fuse_bp:
                f = self._project(self.at, c, f, self._kb, mode=ck.MODE_UPDATE, aux0=f, aux1=self.norm)
                self._record("bp")
            else:
                bp = self.back(c)
                self._record("bp")
                f = self.update(f, bp)
                self._record("update")
            return f

    def _onepass_iteration(self, f: Any) -> Any:
        """The one pass (its registry launcher: one GPU's part, the whole matrix here) and the update, then
        one read of the fixed point's overflow flag.

        The kernel, the conversion and the update run back to back; the new
        image goes to the other of two buffers (``f`` is left as it was), so
        that after the flag is read, an overflow (a term out of the fixed
        point's range: not seen in practice with the bound from the norm) is
        redone from ``f`` with a range :data:`FIXED_RETRY_FACTOR` times larger,
        which is kept for the next iterations, as on N GPUs
        (:meth:`mlemlib.backends.nccl.NcclBackend`). The flag is read after
        the iteration's last event: the host round trip is no longer inside it.
        """
        cp = ck.cupy()
        if self._images is None:
            self._images = [cp.empty(self.shape[1], dtype=cp.float32) for _ in range(2)]
        out = self._images[1] if f is self._images[0] else self._images[0]
        step = registry.launcher(self._kb)
        for attempt in range(FIXED_RETRIES + 1):
            if self.deterministic:
                self._acc.fill(0)
                self._flag.fill(0)
            scale = step(self.a, self.g, f, fp=self._fp, bp=self._bp, acc=self._acc, flag=self._flag,
                         bound=self._fixed_bound, lanes=self._lanes_onepass, bg=self.bg,
                         limits=self._limits)
            if attempt == 0:
                self._record("bp")
            if self.deterministic:
                self.fixed_stats.update(scale=scale, bound=self._fixed_bound)
                ck.update_fixed(f, self._acc, scale, self.norm, out=out)
            else:
                self.update(f, self._bp, out)
            self._record("update" if attempt == 0 else "retry")
            if not self.deterministic or not int(self._flag.get()[0]):
                break
            if attempt == FIXED_RETRIES:
                raise DeviceError(f"fixed-point accumulation overflowed after {FIXED_RETRIES} larger ranges")
            log.info("fixed-point overflow at bound %.3g: the iteration is redone with a larger one", self._fixed_bound)
            self._fixed_bound *= FIXED_RETRY_FACTOR
            self.fixed_stats["retries"] = self.fixed_stats.get("retries", 0) + 1
        return out

    def last_step_times(self) -> dict[str, float]:
        """Seconds per step of the last :meth:`iterate` (synchronises on its last event)."""
        if not self._event_order:
            return dict(self._times)
        self._times = self._read_times(self._events, self._event_order)
        return dict(self._times)

    pipelines = True

    def previous_step_times(self) -> dict[str, float] | None:
        """Seconds per step of the iteration before the last :meth:`iterate`; None before the second.

        Synchronises on that iteration's last event only: the last one may
        still run (and the host may queue the next) while these are read.
        """
        if not self._prev_order:
            return None
        return self._read_times(self._prev_events, self._prev_order)

    def _read_times(self, events: dict[str, Any], order: list[str]) -> dict[str, float]:
        """The step times between the recorded ``events`` (in ``order``) and their span, ``iteration``."""
        cp = ck.cupy()
        with self._device:
            last = events[order[-1]]
            last.synchronize()
            times: dict[str, float] = {}
            prev = events[order[0]]
            for name in order[1:]:
                ev = events[name]
                times[name] = cp.cuda.get_elapsed_time(prev, ev) / 1e3
                prev = ev
            times["iteration"] = cp.cuda.get_elapsed_time(events[order[0]], last) / 1e3
        return times

    def synchronize(self) -> None:
        """Wait for every stream of this backend's GPU."""
        self._device.synchronize()

    # --- set-up and transfers ------------------------------------------------------
    def initial_image(self) -> Any:
        value = self._initial_value()
        cp = ck.cupy()
        with self._device:
            return cp.full(self.shape[1], value, dtype=cp.float32)

    def to_host(self, f: Any) -> np.ndarray:
        with self._device:
            return np.asarray(f.get(), dtype=np.float32)

    def from_host(self, f: np.ndarray) -> Any:
        f = self._check_image(f, np.float32)
        cp = ck.cupy()
        with self._device:
            return cp.asarray(f)

    def describe(self) -> dict[str, Any]:
        from mlemlib.devices import device_facts

        fused = []
        if self.fuse_fp:
            fused.append("corr into fp")
        if self.fuse_bp:
            fused.append("update into bp")
        try:
            dev = device_facts(self.device_id)
        except DeviceError as exc:  # pragma: no cover - device seen at construction
            dev = {"error": str(exc)}
        out = {
            "backend": self.name,
            "deterministic": self.deterministic,
            "fp": self.fp_kernel,
            "bp": self.bp_kernel,
            "bp_requested": self.bp_requested,
            "smem_local_chunks": self.smem_local_fraction,
            "chunks": {"count": self.a.chunks, "window": self.a.window, "reuse": round(self.a.reuse, 3),
                       "file": self.chunk_file} if self.chunked else None,
            "chunk_reuse_sample": self.chunk_reuse_sample,
            "chunks_estimated": self.chunk_estimate,
            "transpose": self.transpose_source,
            "format": self.format,
            "bytes_per_nnz": {"A": bytes_per_nnz(self.a), "AT": bytes_per_nnz(self.at)},
            "onepass": self.onepass,
            "l2_window": self.l2_window,
            "layout": {"A": getattr(self.a, "layout", None), "AT": getattr(self.at, "layout", None)},
            "fixed_point": dict(self.fixed_stats) if self.onepass and self.deterministic else None,
            "lanes_fp": self._lanes(self.a) if self._kf is not None and self._kf.lanes else None,
            "shape_fp": ck.shape_label(self.a) if self._kf is not None and self._kf.shapes else None,
            "shape_bp": ck.shape_label(self.at) if self.at is not None and self._kb.shapes else None,
            "lanes_bp": (self._lanes(self.at) if self.at is not None else self._lanes(self.a))
            if self._kb.lanes
            else None,
            "secsize": self.secsize if self._kb.secsize or (self._kf is not None and self._kf.secsize) else None,
            "fused": fused,
            "steps": ["bp", "update"] if self.onepass else [
                s for s in STEPS if not (s == "corr" and self.fuse_fp) and not (s == "update" and self.fuse_bp)
            ],
            "device": {"index": self.device_id, **dev},
            "memory": self.memory,
            "setup": getattr(self, "setup_record", None),
        }
        return out


def _release_l2_on(device_id: int) -> None:
    """Give back the L2 set aside on GPU ``device_id`` (a finalizer: it must not raise)."""
    try:
        with ck.cupy().cuda.Device(device_id):
            cc().release_l2()
    except Exception as exc:  # pragma: no cover - a torn-down context
        log.debug("GPU %d: releasing the L2 set-aside: %s", device_id, exc)


def cc():
    """The compressed-format and one-pass launchers (:mod:`mlemlib.backends._compressed_cuda`)."""
    from mlemlib.backends import _compressed_cuda

    return _compressed_cuda
