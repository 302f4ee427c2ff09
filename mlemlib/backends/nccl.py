"""The ``cuda-nccl`` backend: MLEM on several GPUs with NCCL all-reduces (CUDA only; CuPy imported lazily).

Each GPU holds an nnz-balanced part of the problem (the partition stage's
``plan.json``, or the same split computed in memory) and runs the one-GPU
kernels of :mod:`mlemlib.backends._cuda_kernels` on it; NCCL (through
``cupy.cuda.nccl``) sums the partial vectors. Two layouts:

``local`` (default)
    GPU ``k`` holds the row block ``A_k`` (rows ``[r0, r1)``) and its
    transpose ``A_k^T`` (``n x (r1 - r0)``, the plan's ``part-{k}.h5``, or
    transposed on the GPU). Forward projection, correlation (fused into it)
    and back projection are local; one in-place all-reduce of the n-long
    back projection per iteration; the update runs on every GPU
    (replicated image).
``thesis`` (the thesis, ch. 8)
    GPU ``k`` computes the forward projection of its row block into a
    full-length vector that is zero elsewhere; an all-reduce (sum) gives
    every GPU the whole forward projection; each computes the correlation
    of all m rows and back-projects an nnz-balanced row block ``[c0, c1)``
    of ``A^T`` (the plan's ``transpose_rows``) with the update fused, into a
    zeroed full-length image; an all-reduce of the image completes the
    iteration. Sums with zeros are exact, so this layout gives the
    one-GPU image bit for bit.

``graph=True`` captures one whole iteration, every GPU's kernels and the
NCCL calls, as one CUDA graph per GPU (``Stream.begin_capture``) and replays
it, so an iteration costs P graph launches instead of ~5 P kernel launches
plus event records from Python. Per-step times are then not observable
(only ``iteration``); run with ``graph=False`` to see the steps.

One process drives all its GPUs (``NcclCommunicator.initAll``); the same
class runs one GPU per process when :mod:`mlemlib.dist.mpi` hands it a
communicator spanning several processes. Where one process drives every GPU, each pair has
peer access and the back projection is the deterministic kernels' fixed point, its sum over the GPUs
runs over NVLink peer access instead of NCCL (:mod:`mlemlib.backends._peer`; ``exchange``).

The backend's concerns live in four modules: the host-side planning (its kernels, the
partition plan: :mod:`mlemlib.backends._nccl_plan`), what each GPU holds and its loading
(:mod:`mlemlib.backends._nccl_shards`), the peer exchange (:mod:`mlemlib.backends._peer`), and here
the set-up, the iteration's launches (all-reduces, the one pass), graph capture and timing.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import gc
import logging
import os
import time
import weakref
from typing import Any

import numpy as np

from mlemlib import registry, setup_times
from mlemlib.backends import _compressed_cuda as cc
from mlemlib.backends import _cuda_kernels as ck
from mlemlib.backends import _cuda_plan as cplan
from mlemlib.backends.base import (
    FIXED_RETRIES,
    FIXED_RETRY_FACTOR,
    ONEPASS_C_MAX,
    Backend,
    bytes_per_nnz,
    calibrated_bound,
)
from mlemlib.backends._nccl_plan import build_plan, plan_has_parts
from mlemlib.backends._nccl_shards import Shard, load_shard
from mlemlib.backends.cuda import chunk_layout, sample_chunks
from mlemlib.errors import ConfigError, DeviceError
from mlemlib.formats.spec import matrix_format_of
from mlemlib.matrix import shape_nnz

log = logging.getLogger(__name__)



# --------------------------------------------------------------------------- device helpers


def _cupy():
    return ck.cupy()


def _nccl():
    cp = _cupy()
    try:
        from cupy.cuda import nccl
    except ImportError as exc:  # pragma: no cover - depends on the CuPy build
        raise DeviceError(f"CuPy was built without NCCL: {exc}") from exc
    if not getattr(nccl, "available", True):  # pragma: no cover
        raise DeviceError("CuPy's NCCL module is not available (install nvidia-nccl for your CUDA)")
    del cp
    return nccl


class NcclBackend(Backend):
    """MLEM on several GPUs of one process (or one GPU per process under :mod:`mlemlib.dist.mpi`).

    Parameters
    ----------
    matrix
        ``A`` (m x n): an opened matrix (``read_rows``; each GPU reads only
        its row range), a :class:`CSRMatrix`, a SciPy matrix, or a
        ``DeviceCSR`` on any GPU (row blocks are copied GPU to GPU).
    g
        Measurement (length m).
    norm
        Column sums of ``A`` (length n; summed in float64 for the initial image).
    transpose
        ``A^T`` in any form of ``matrix``, or None. The thesis layout needs
        it (or a plan naming it); the local layout takes ``A_k^T`` from the
        plan's part files or transposes ``A_k`` on its GPU.
    gpus
        Number of GPUs of this process (devices ``0 .. gpus-1``) when
        ``devices`` is not given.
    devices
        CUDA device indices of this process.
    layout
        ``local`` or ``thesis`` (module docstring).
    plan
        ``plan.json`` path/directory, a plan dict, or None (split in memory).
    fp, bp, secsize, lanes
        Kernels as in :class:`mlemlib.backends.cuda.CudaBackend`; ``lanes``
        fixes the lanes per row of both projections.
    fuse
        Fuse the correlation into the local forward projection, and the
        update into the thesis back projection (then the thesis layout
        all-reduces the image rather than the back projection).
    graph
        Capture the iteration as CUDA graphs and replay them. None (the
        default, ``auto``): on for several GPUs where the kernels can be
        captured, off on one (:func:`graph_default`). A
        fixed-point iteration that overflows inside a graph is redone kernel
        by kernel with a larger range and captured again.
    tune
        Time ``csr_vector``'s launch shapes on each GPU's blocks at set-up and
        keep the fastest (never changes a result; see
        :meth:`mlemlib.backends._cuda_kernels.DeviceCSR.tune`).
    chunks
        The row chunks of ``matrix`` as a layout file (``mlem chunk``; path
        or :class:`mlemlib.chunked.ChunkLayout`), checked against ``matrix``:
        with ``onepass_chunked`` each GPU loads a contiguous, nnz-balanced
        range of its chunks (not the plan's rows) instead of chunking its
        rows; ``bp=auto`` decides from its exact reuse and chunk count.
    parts, world, comms, own_comms
        Multi-process use (:mod:`mlemlib.dist.mpi`): the plan parts this
        process owns (one per device), the total number of parts (ranks),
        the communicators (one per device) and whether :meth:`close`
        destroys them. Default: this process owns all parts and creates
        (and later destroys) the communicators with ``initAll``.
    exchange
        How the back projection is summed over the GPUs each iteration
        (:func:`mlemlib.backends._peer.choose_exchange`): ``auto`` (the
        default) sums the deterministic kernels' fixed point over NVLink peer
        access where one process drives every GPU and each pair has peer
        access (:class:`mlemlib.backends._peer.PeerExchange`: the same bits,
        in half NCCL's time on madpet2), and through NCCL otherwise; ``nccl``
        always through NCCL; ``peer`` refused in one line where it does not
        apply.

    Raises
    ------
    ConfigError
        Bad layout, kernel, plan or GPU count.
    DeviceError
        No CuPy/NCCL, too few GPUs, out of memory.
    """

    name = "cuda-nccl"

    @setup_times.records
    def __init__(
        self,
        matrix: Any,
        g: Any,
        norm: Any,
        transpose: Any | None = None,
        *,
        gpus: int | None = None,
        devices: list[int] | None = None,
        layout: str = "local",
        plan: Any | None = None,
        fp: str = "auto",
        bp: str = "auto",
        secsize: int | None = None,
        lanes: int | None = None,
        fuse: bool = True,
        graph: bool | None = None,
        tune: bool = True,
        parts: list[int] | None = None,
        world: int | None = None,
        comms: list[Any] | None = None,
        own_comms: bool = False,
        chunks: Any | None = None,
        background: Any | None = None,
        subsets: Any | None = None,
        share: NcclBackend | None = None,
        exchange: str = "auto",
    ) -> None:
        super().__init__()
        _cupy()  # CuPy and its NCCL module, or DeviceError before anything is read
        _nccl()
        self._peer: Any = None  # the peer exchange, where _set_up_exchange chooses it
        from mlemlib.formats import open_matrix

        self.layout = layout
        if isinstance(matrix, (str, os.PathLike)):
            matrix = open_matrix(matrix)
        self.matrix_format = matrix_format_of(matrix)
        self.format = self.matrix_format.name
        nworld = world or len(devices or []) or gpus or 2
        own_layout = self._decide_kernels(matrix, transpose, fp, bp, layout, plan, chunks, devices, nworld)
        self._choose_graph(graph, nworld)
        self._take_launch_options(secsize, lanes)
        devices, parts = self._check_devices(gpus, devices, parts, world)
        self._choose_exchange(exchange, devices)
        self.fuse = bool(fuse)
        plan_d, transpose = self._plan_parts(matrix, transpose, plan, layout)
        g, norm, bg = self._check_inputs(g, norm, subsets, background, share, devices, layout)
        self._choose_lanes(lanes, norm)
        self._load_shards(matrix, transpose, plan_d, g, norm, bg, parts, devices, layout, share, tune, own_layout)
        self._lanes_of_padded_rows(lanes, devices)
        self._set_up_comms(comms, own_comms, share, devices)
        self._set_up_exchange(share, devices)
        #: The algorithm's update in place of EM's (:meth:`set_image_step`).
        self.image_step: Any = None
        self._closed = False
        atexit.register(_close_at_exit, weakref.ref(self))
        self._warm_up_and_capture()
        log.info(
            "cuda-nccl backend: %d GPU(s) %s of %d, layout %s, fp=%s bp=%s, graph=%s (loaded in %.2f s)",
            len(devices), devices, self.world, layout, self.fp_kernel, self.bp_kernel, self.graph, self.load_seconds,
        )

    # --- set-up steps, in the constructor's order ------------------------------------------
    def _decide_kernels(self, matrix: Any, transpose: Any | None, fp: str, bp: str, layout: str, plan: Any | None,
                        chunks: Any | None, devices: list[int] | None, nworld: int) -> bool:
        """Open the chunk layout and decide the kernels as on one GPU; whether the layout was opened here."""
        # A_k^T in the local layout: transposed on its GPU (CSR) or the plan's part files; a whole A^T only
        # serves the thesis layout's row blocks
        t_avail = self.matrix_format.cusparse or plan_has_parts(plan) or (layout == "thesis" and transpose is not None)
        self._layout, own_layout = chunk_layout(chunks, matrix) if layout == "local" else (None, False)
        if own_layout:
            weakref.finalize(self, self._layout.close)
        dev0 = (devices or [0])[0]
        lay = self._layout
        # the same decision as on one GPU (registry.decide), each GPU's share of the chunks counted
        choice = registry.decide(
            "cuda", fp, bp, fmt=self.format, gpus=nworld, check_gpus=max(2, nworld), layout=layout,
            transpose_available=t_avail or layout == "thesis", sms=ck.device_properties(dev0)["sm_count"],
            sample=lambda: (lay.reuse, lay.chunks) if lay is not None else sample_chunks(matrix, dev0),
        )
        self.fp_kernel, self.bp_kernel, self.deterministic = choice.fp, choice.bp, choice.deterministic
        self.chunk_reuse_sample: float | None = choice.reuse
        if choice.reuse is not None and choice.chunked:
            log.info("bp=auto: %s reuse each voxel %.1f times (%.0f chunks, %d GPUs): %s",
                     "the layout's chunks" if lay is not None else "chunks of a sample",
                     choice.reuse, choice.chunks, nworld, choice.bp)
        self._kb = registry.get_bp("cuda", self.bp_kernel)
        self.onepass = self._kb.op == "iteration"
        self._kf = None if self.onepass else registry.get("cuda", "forward", self.fp_kernel)
        # the forward projection alone (forward(), diagnostics): a one pass's is its format's row kernel
        self._k_forward = self._kf or registry.row_forward(self.format)
        return own_layout

    def _choose_graph(self, graph: bool | None, nworld: int) -> None:
        """Whether the iteration runs as captured CUDA graphs (:func:`graph_default`), and the replays' state."""
        self.graph = graph_default(graph, nworld > 1, self._graphable())
        self.graph_capturing = False
        # a fixed-point one pass's replays alternate between two graphs, each with its own overflow flag and
        # copy of the image it starts from; a replay's flag is read after the next replay is queued
        self._parity = 0  # the graph the next replay takes
        self._pending: int | None = None  # the graph of the last replay whose flag is not read yet
        if self.graph and not self._graphable():
            raise ConfigError("graph", f"graph capture needs non-allocating kernels; fp={self.fp_kernel} bp={self.bp_kernel} use cuSPARSE through CuPy")

    def _take_launch_options(self, secsize: int | None, lanes: int | None) -> None:
        """Check and keep ``merge``'s section size; check the lanes per row given."""
        self.secsize = cplan.DEFAULT_SECSIZE if secsize is None else int(secsize)
        if self.secsize < 1:
            raise ConfigError("secsize", f"section size must be >= 1, got {secsize}")
        if lanes is not None and lanes not in cplan.LANE_CHOICES:
            raise ConfigError("lanes", f"lanes per row must be one of {cplan.LANE_CHOICES}, got {lanes}")

    def _check_devices(self, gpus: int | None, devices: list[int] | None, parts: list[int] | None,
                       world: int | None) -> tuple[list[int], list[int]]:
        """Check the GPUs and the plan parts they take, and keep the devices and world size; (devices, parts)."""
        cp = _cupy()
        try:
            ndev = cp.cuda.runtime.getDeviceCount()
        except Exception as exc:
            raise DeviceError(f"no CUDA GPU usable: {exc}") from exc
        if devices is None:
            if gpus is None or int(gpus) < 1:
                raise ConfigError("gpus", f"number of GPUs must be >= 1, got {gpus}")
            devices = list(range(int(gpus)))
        devices = [int(d) for d in devices]
        if len(set(devices)) != len(devices) or not devices:
            raise ConfigError("gpus", f"devices must be distinct and at least one, got {devices}")
        if max(devices) >= ndev or min(devices) < 0:
            raise DeviceError(f"GPUs {devices} requested but {ndev} visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        if parts is None:
            parts = list(range(len(devices)))
        if len(parts) != len(devices):
            raise ConfigError("parts", f"{len(parts)} parts for {len(devices)} devices")
        self.world = len(devices) if world is None else int(world)
        self.devices = devices
        return devices, parts

    def _plan_parts(self, matrix: Any, transpose: Any | None, plan: Any | None, layout: str) -> tuple[dict, Any]:
        """The problem's shape and the partition plan; (the plan, the transpose: the plan's for the thesis layout)."""
        from mlemlib.formats import open_matrix

        (m, n), nnz = shape_nnz(matrix)
        self.shape = (m, n)
        self.nnz = nnz
        plan_d = build_plan(matrix, transpose, self.world, plan, layout)
        self.plan = {k: plan_d.get(k) for k in ("parts", "imbalance", "transpose_imbalance", "plan")}
        if transpose is None and layout == "thesis" and plan_d.get("transpose"):
            transpose = open_matrix(plan_d["transpose"])
        if transpose is not None:
            (tm, tn), tnnz = shape_nnz(transpose)
            if (tm, tn) != (n, m) or tnnz != nnz:
                raise ConfigError("transpose", f"transpose is {(tm, tn)} with {tnnz} nnz, expected {(n, m)} with {nnz}")
        return plan_d, transpose

    def _check_inputs(self, g: Any, norm: Any, subsets: Any | None, background: Any | None,
                      share: NcclBackend | None, devices: list[int], layout: str) -> tuple[Any, Any, Any]:
        """Check the measurement, norm, subsets, background and a shared backend; (g, norm, background)."""
        m, n = self.shape
        g, norm, bg = self._check_one_subset(g, norm, subsets, background, (m, n))
        if share is not None and (share.devices != devices or share.layout != layout):
            raise ConfigError("share", f"a backend shares the GPUs {share.devices} ({share.layout} layout) of "
                                       f"another only with the same devices and layout, not {devices} ({layout})")
        return g, norm, bg

    def _choose_lanes(self, lanes: int | None, norm: Any) -> None:
        """The lanes per row of the whole matrix, and the fixed point's range from the norm."""
        (m, n), nnz = self.shape, self.nnz
        # Lanes of the whole matrix, so each row is summed as on one GPU (deterministic across GPU counts).
        self.lanes_override = lanes
        self.lanes_fp = lanes or (cplan.choose_lanes(nnz / m if m else 0.0) if not self.matrix_format.compressed
                                  else cc.onepass_lanes(m, nnz, self.format))
        # one-pass lanes from the whole matrix (the same on every GPU: each row is summed the same way)
        self.lanes_onepass = cc.onepass_lanes(m, nnz, self.format)
        self._fixed_bound = ONEPASS_C_MAX * float(np.nanmax(norm)) if np.size(norm) else 1.0
        self.lanes_bp_cap = cplan.LANE_CHOICES[-1]
        self.lanes_bp_global = lanes or cplan.choose_lanes(nnz / n if n else 0.0, self.lanes_bp_cap)

    def _load_shards(self, matrix: Any, transpose: Any | None, plan_d: dict, g: Any, norm: Any, bg: Any,
                     parts: list[int], devices: list[int], layout: str, share: NcclBackend | None, tune: bool,
                     own_layout: bool) -> None:
        """Load each GPU's part (``self.shards``), one thread per GPU, while the kernels compile."""
        cp = _cupy()
        # the kernels compile in the background (once for the GPUs' architecture) while the parts load
        ck.prefetch_kernels(registry.kernels_of("cuda", self.fp_kernel, self.bp_kernel), devices[0],
                            tune=tune and not self.matrix_format.compressed)
        ck.prefetch_kernels([self._k_forward], devices[0], tune=False)
        t0 = time.perf_counter()
        self.shards: list[Shard] = []
        local_files = plan_d.get("local_transpose")
        # A layout file's chunks split over the GPUs instead of the plan's rows: a row's sums and its terms'
        # fixed point do not depend on the chunk it is in, so any split gives the same image bit for bit.
        chunk_ranges = self._layout.ranges(self.world) if self._kb.chunks and self._layout is not None else None
        self.chunk_file = self._layout.path if chunk_ranges is not None else None
        def load(i: int) -> Shard:
            return load_shard(self, parts[i], devices[i], matrix=matrix, transpose=transpose, plan_d=plan_d, g=g,
                              norm=norm, chunk_ranges=chunk_ranges, local_files=local_files, tune=tune, bg=bg,
                              share=share.shards[i] if share is not None else None)

        try:
            # Each GPU reads, checks, uploads and tunes its part in a thread of its own (the reads are the
            # file's, the rest overlaps); the first part alone first where it settles the notrans selector
            # for all.
            first = 1 if self._kb.selector else 0
            self.shards = [load(i) for i in range(first)]
            if len(devices) - first > 1:
                if self.matrix_format.cusparse:
                    # the threads may transpose with cuSPARSE; its modules (which import each other) are
                    # imported here, once: two threads importing them at once can deadlock in Python's import locks
                    import cupyx.cusparse  # noqa: F401
                    import cupyx.scipy.sparse  # noqa: F401
                with concurrent.futures.ThreadPoolExecutor(len(devices) - first, "mlem-load") as pool:
                    self.shards += list(pool.map(load, range(first, len(devices))))
            else:
                self.shards += [load(i) for i in range(first, len(devices))]
            for s in self.shards:
                log.info("GPU %d: part %d rows [%d, %d) (%d nnz)%s", s.device, s.part, *s.rows, s.nnz,
                         ", A^T rows [%d, %d)" % s.cols if layout == "thesis" else "")
        except cp.cuda.memory.OutOfMemoryError as exc:
            raise DeviceError(f"out of GPU memory loading the parts ({exc}); use more GPUs") from exc
        # Loading ran on each device's default stream; the iteration runs on non-blocking streams.
        with setup_times.phase("to_gpu"):
            for dev in devices:
                with cp.cuda.Device(dev):
                    cp.cuda.runtime.deviceSynchronize()
        if own_layout:
            self._layout.close()
        self.load_seconds = time.perf_counter() - t0

    def _lanes_of_padded_rows(self, lanes: int | None, devices: list[int]) -> None:
        """A compressed matrix's forward lanes from its padded rows, where every part is here and none is given."""
        m, _n = self.shape
        slots = [getattr(s.a, "slots", None) for s in self.shards]
        if self.matrix_format.compressed and not lanes and self.world == len(devices) and None not in slots:
            # a compressed matrix's lanes from its padded rows, as one GPU's backend takes them (DeviceCompressed.lanes)
            self.lanes_fp = cc.choose_lanes(sum(int(v) for v in slots) / 4 / m if m else 0.0)

    def _set_up_comms(self, comms: list[Any] | None, own_comms: bool, share: NcclBackend | None,
                      devices: list[int]) -> None:
        """Give each shard its communicator (the shared backend's, the given, or new ones), then the add limits."""
        nccl = _nccl()
        if share is not None:
            comms, own_comms = [s.comm for s in share.shards], False
        if comms is None:
            if self.world != len(devices):
                raise ConfigError("comms", "several processes need communicators (see mlemlib.dist.mpi)")
            with setup_times.phase("comms"):
                comms = (nccl.NcclCommunicator.initAll(devices) if len(devices) > 1
                         else [self._single_comm(dev) for dev in devices])
            self._owns_comms = True
        else:
            self._owns_comms = bool(own_comms)
        if len(comms) != len(devices):
            raise ConfigError("comms", f"{len(comms)} communicators for {len(devices)} devices")
        for s, comm in zip(self.shards, comms):
            s.comm = comm
        self.nccl_version = int(nccl.get_version())
        self._limits = self._fixed_limits() if self._kb.limits else None

    def _choose_exchange(self, exchange: str, devices: list[int]) -> None:
        """Choose how the back projection is summed over the GPUs (:func:`~mlemlib.backends._peer.choose_exchange`;
        before anything is loaded: ``peer`` where it does not apply is refused in one line)."""
        from mlemlib.backends import _peer

        self.exchange = _peer.choose_exchange(exchange, world=self.world, local=len(devices),
                                              fixed_point=self._fixed_point, peer_access=lambda: _peer.peer_access(devices))

    def _set_up_exchange(self, share: NcclBackend | None, devices: list[int]) -> None:
        """Set up the peer exchange where it was chosen (the shared backend's, where there is one)."""
        from mlemlib.backends import _peer

        if self.exchange == "peer":
            if share is not None and share._peer is not None and share._peer.devices == list(devices):
                self._peer = share._peer
            else:
                with setup_times.phase("comms"):
                    self._peer = _peer.PeerExchange(devices)

    def _warm_up_and_capture(self) -> None:
        """Run the warm-up iteration, then capture the iteration's graphs where ``graph``."""
        with setup_times.phase("warm_up"):
            self._warm_up()
        if self.graph:
            with setup_times.phase("graph"):
                self._capture()

    @property
    def _fused_fp(self) -> bool:
        """The local forward projection fuses the correlation (its kernel's epilogue)."""
        return self.fuse and self._kf is not None and self._kf.fused

    def _graphable(self) -> bool:
        """Whether a CUDA graph can capture the iteration's kernels (none allocates)."""
        return self._kb.graph and (self._kf is None or self._kf.graph)

    @staticmethod
    def _single_comm(dev: int) -> Any:
        """A one-rank communicator (so P = 1 runs the same code path)."""
        cp = _cupy()
        nccl = _nccl()
        with cp.cuda.Device(dev):
            return nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)

    # --- the iteration, as launches ------------------------------------------------------
    def _mark(self, s: Shard, name: str, record: bool) -> None:
        if not record:
            return
        cp = _cupy()
        ev = s.events.get(name)
        if ev is None:
            ev = s.events[name] = cp.cuda.Event()
        ev.record(s.stream)
        s.order.append(name)

    def _fixed_limits(self) -> tuple[int, int]:
        """The fixed-point one pass's add limits (:func:`~mlemlib.backends._compressed_cuda.fixed_limits`):
        each GPU counts its block's longest column, one all-reduce sums the counts over every rank."""
        cp = _cupy()
        counts = []
        for s in self.shards:
            with cp.cuda.Device(s.device), s.stream:
                counts.append(cp.full(1, cc.column_count_max(s.a), dtype=cp.uint64))
        self._allreduce([(c, c) for c in counts], _nccl().NCCL_UINT64)
        s = self.shards[0]
        with cp.cuda.Device(s.device):
            terms = int(counts[0].get(stream=s.stream)[0])
        return cc.fixed_limits(terms, self.world)

    def _allreduce(self, pairs: list[tuple[Any, Any]], dtype: Any = None, *, image: bool = False) -> None:
        """Grouped sum all-reduce: ``pairs[k] = (send, recv)`` on shard k's stream (float32, or ``dtype``).

        One rank in all (one GPU, one process) sums nothing: ``recv`` gets ``send`` without a launch
        where they are one buffer, by a copy where not. ``image``: the iteration's in-place sum of the fixed-point
        back projection, which the peer exchange does where it was chosen (:attr:`exchange`).
        """
        cp = _cupy()
        nccl = _nccl()
        if self.world == 1:
            for s, (send, recv) in zip(self.shards, pairs):
                if send.data.ptr != recv.data.ptr:
                    with cp.cuda.Device(s.device), s.stream:
                        recv[...] = send
            return
        if image and self._peer is not None:
            self._peer.allreduce([recv for _, recv in pairs], [s.stream for s in self.shards])
            return
        kind = nccl.NCCL_FLOAT32 if dtype is None else dtype
        nccl.groupStart()
        try:
            for s, (send, recv) in zip(self.shards, pairs):
                with cp.cuda.Device(s.device):
                    s.comm.allReduce(send.data.ptr, recv.data.ptr, send.size, kind, nccl.NCCL_SUM, s.stream.ptr)
        finally:
            nccl.groupEnd()

    def _spmv(self, a: Any, x: Any, out: Any, lanes: int, **kw: Any) -> Any:
        """``out = a x`` by the forward (``fwd=True``) or back-projection kernel, through its registry launcher."""
        k = self._kf if kw.pop("fwd", False) else self._kb
        return registry.launcher(k)(a, x, out, lanes=lanes, secsize=self.secsize, **kw)

    def _onepass(self, record: bool) -> None:
        """The local layout's one-pass iteration: each GPU's pass over its rows (the kernel's registry
        launcher: ``onepass``, ``onepass_fixed``, ``onepass_chunked``), one all-reduce of bp, the update.

        The fixed-point kernels sum 64-bit integers (every GPU with the same
        scale) and all-reduce them as integers, so the image is the same bits
        for every GPU count, one GPU's backend included; an overflow (a
        correlation above the range) is detected after the all-reduce and the
        iteration is redone with a range 2^20 times larger. Captured in a graph
        with the peer exchange and EM's update, the exchange updates the image
        too (:meth:`~mlemlib.backends._peer.PeerExchange.allreduce_update`, or
        the algorithm's :meth:`~mlemlib._map_cuda.DeviceMapStep.launch_peer`: each
        GPU its slice; the same bits): a replay that overflowed is redone from
        the image it started from.
        """
        cp = _cupy()
        nccl = _nccl()
        step = registry.launcher(self._kb)
        scale = None
        # the peer exchange is chosen for the fixed point only (choose_exchange)
        if self._peer is not None and not self.graph_capturing:  # the address tables, made before any capture
            self._peer.register([s.acc for s in self.shards], [s.f for s in self.shards])
        fused = self._peer is not None and self.graph_capturing
        for attempt in range(FIXED_RETRIES + 1):
            for s in self.shards:
                with cp.cuda.Device(s.device), s.stream:
                    self._mark(s, "start", record)
                    if self.deterministic:
                        s.acc.fill(0)
                        s.flag.fill(0)
                    scale = step(s.a, s.g, s.f, fp=s.fp, bp=s.bp, acc=s.acc, flag=s.flag, bound=self._fixed_bound,
                                 lanes=self.lanes_onepass, bg=s.bg, limits=self._limits)
                    self._mark(s, "bp", record)
            if fused:
                break
            if self.deterministic:
                self._allreduce([(s.acc, s.acc) for s in self.shards], nccl.NCCL_UINT64, image=True)
            else:
                self._allreduce([(s.bp, s.bp) for s in self.shards])
            if not self.deterministic or self.graph_capturing:
                break
            bad = 0
            for s in self.shards:
                with cp.cuda.Device(s.device), s.stream:
                    bad |= int(s.flag.get(stream=s.stream)[0])
            if not bad:
                break
            if attempt == FIXED_RETRIES:
                raise DeviceError(f"fixed-point accumulation overflowed (flag {bad}) after {FIXED_RETRIES} retries")
            self._fixed_bound *= FIXED_RETRY_FACTOR
            log.info("%s: overflow (flag %d); range raised to %.3g", self.bp_kernel, bad, self._fixed_bound)
        self._scale = scale
        if fused:
            fs, norms = [s.f for s in self.shards], [s.norm for s in self.shards]
            accs, streams = [s.acc for s in self.shards], [s.stream for s in self.shards]
            if self.image_step is not None:
                self.image_step.launch_peer(self._peer, fs, norms, accs, scale, streams)
            else:
                self._peer.allreduce_update(accs, fs, norms, scale, streams)
            return
        for s in self.shards:
            with cp.cuda.Device(s.device), s.stream:
                self._mark(s, "allreduce", record)
                if self.deterministic:
                    self._update(s, acc=s.acc, scale=scale)
                else:
                    self._update(s, bp=s.bp)
                self._mark(s, "update", record)

    def _launch(self, record: bool) -> None:
        """Launch one iteration on every shard's stream (events when ``record``)."""
        cp = _cupy()
        fused_fp = self._fused_fp
        for s in self.shards:
            s.order = []
        if self.onepass:
            self._onepass(record)
            return
        if self.layout == "local":
            for s in self.shards:
                with cp.cuda.Device(s.device), s.stream:
                    self._mark(s, "start", record)
                    if fused_fp:
                        self._spmv(s.a, s.f, s.c, self.lanes_fp, fwd=True, **ck.correlation_epilogue(s.g, s.bg))
                        self._mark(s, "fp", record)
                    else:
                        self._spmv(s.a, s.f, s.fp, self.lanes_fp, fwd=True)
                        self._mark(s, "fp", record)
                        ck.correlate(s.g, s.fp, out=s.c, bg=s.bg)
                        self._mark(s, "corr", record)
                    if s.at is not None:
                        self._spmv(s.at, s.c, s.bp, self.lanes_bp(s))
                    else:
                        registry.launcher(self._kb)(s.a, s.c, s.bp, lanes=self.lanes_fp, smem=s.smem)
                    self._mark(s, "bp", record)
            self._allreduce([(s.bp, s.bp) for s in self.shards])
            for s in self.shards:
                with cp.cuda.Device(s.device), s.stream:
                    self._mark(s, "allreduce", record)
                    self._update(s, bp=s.bp)
                    self._mark(s, "update", record)
            return
        # thesis layout
        for s in self.shards:
            with cp.cuda.Device(s.device), s.stream:
                self._mark(s, "start", record)
                r0, r1 = s.rows
                self._spmv(s.a, s.f, s.send[r0:r1], self.lanes_fp, fwd=True)
                self._mark(s, "fp", record)
        self._allreduce([(s.send, s.fp) for s in self.shards])
        for s in self.shards:
            with cp.cuda.Device(s.device), s.stream:
                self._mark(s, "allreduce", record)
                ck.correlate(s.g, s.fp, out=s.c, bg=s.bg)
                self._mark(s, "corr", record)
                c0, c1 = s.cols
                if self.fuse:
                    self._spmv(s.at, s.c, s.img_send[c0:c1], self.lanes_bp(s), mode=ck.MODE_UPDATE, aux0=s.f[c0:c1], aux1=s.norm[c0:c1])
                else:
                    self._spmv(s.at, s.c, s.img_send[c0:c1], self.lanes_bp(s))
                self._mark(s, "bp", record)
        # fused: the blocks already hold the updated image, so the sum is the new image itself
        self._allreduce([(s.img_send, s.f if self.fuse else s.bp) for s in self.shards])
        for s in self.shards:
            with cp.cuda.Device(s.device), s.stream:
                self._mark(s, "allreduce2", record)
                if not self.fuse:
                    self._update(s, bp=s.bp)
                    self._mark(s, "update", record)

    def _update(self, s: Shard, *, bp: Any = None, acc: Any = None, scale: float | None = None) -> None:
        """The image's update on shard ``s``'s stream from the all-reduced back projection (``bp``, or the
        fixed point ``acc`` at ``scale``): EM's, or the algorithm's :attr:`image_step`."""
        if self.image_step is not None:
            self.image_step.launch(s.f, s.norm, bp=bp, acc=acc, scale=scale)
        elif acc is not None:
            ck.update_fixed(s.f, acc, scale, s.norm, out=s.f)
        else:
            ck.update(s.f, bp, s.norm, out=s.f)

    def takes_image_step(self) -> bool:
        """Whether :meth:`set_image_step` works here: the local layout (the thesis layout fuses EM's update
        into its back projection)."""
        return self.layout == "local"

    def set_image_step(self, step: Any) -> None:
        """Run ``step`` (:class:`mlemlib._map_cuda.DeviceMapStep`) as the update of this backend's iteration
        (with this backend's norm: an OSEM subset's); a captured graph is captured again with it."""
        if not self.takes_image_step():
            raise ConfigError("layout", f"an algorithm's image step runs in the local layout, not {self.layout!r}")
        self.synchronize()  # and read the last replay's overflow flags
        for s in self.shards:
            step.prepare(s.device, s.stream)
        if self._peer is not None and self.deterministic:  # the tables of the pass's fused step, before a capture
            step.register_peer(self._peer, [s.f for s in self.shards], [s.acc for s in self.shards])
        self.image_step = step
        if self.graph and self.shards and self.shards[0].graph is not None:
            self._capture()

    def lanes_bp(self, s: Shard) -> int:
        """Lanes per row of a shard's back projection (the whole A^T's in the thesis layout)."""
        if self.layout == "thesis":
            return self.lanes_bp_global
        if s.at is None or self.lanes_override:
            return self.lanes_bp_global
        return cplan.choose_lanes(s.at.nnz / s.at.shape[0] if s.at.shape[0] else 0.0, self.lanes_bp_cap)

    def _warm_up(self) -> None:
        """Compile kernels, connect NCCL and set kernel attributes before any timing or capture."""
        f = self.initial_image()
        self.iterate(f, _eager=True)
        self.synchronize()
        if self.onepass and self.deterministic:  # the range from what the pass summed (all-reduced: every GPU alike)
            cp = _cupy()
            s = self.shards[0]
            with cp.cuda.Device(s.device):
                top = int(cp.max(s.acc).get()) if s.acc.size else 0
            self._fixed_bound = calibrated_bound(top, self._scale, self._fixed_bound)
        self._times = {}
        for s in self.shards:
            s.order, s.prev_order = [], []

    def capture_graph(self) -> None:
        """Switch to CUDA-graph replay (capture now; as ``graph=True`` at construction)."""
        if not self._graphable():
            raise ConfigError("graph", f"graph capture needs non-allocating kernels, not fp={self.fp_kernel} bp={self.bp_kernel}")
        if not self.graph or self.shards[0].graph is None:
            self._capture()
        self.graph = True

    def use_graph(self, on: bool) -> None:
        """Replay the captured graphs (True) or launch kernel by kernel (False)."""
        if on:
            self.capture_graph()
        else:
            self._settle()
            self.graph = False

    def _capture(self) -> None:
        """Capture one iteration per GPU. A fixed-point one pass's graph first copies the image it starts from
        (:meth:`_check_replay` puts it back); it is captured twice (``graph``, ``graph2``), each with its own
        flag and image copy, and replays alternate between them, so that one replay's flag can be read while
        the next runs."""
        cp = _cupy()
        self._settle()
        fixed = self._fixed_point
        for parity in (0, 1) if fixed else (0,):
            for s in self.shards:
                if fixed:
                    with cp.cuda.Device(s.device):
                        if s.flags is None:
                            s.flags = [s.flag, cp.zeros_like(s.flag)]
                            s.befores = [cp.empty_like(s.f), cp.empty_like(s.f)]
                    s.flag, s.f_before = s.flags[parity], s.befores[parity]
                s.begin_capture(keep_image=fixed)
            self.graph_capturing = True
            try:
                self._launch(record=False)
            finally:
                self.graph_capturing = False
                for s in self.shards:
                    with cp.cuda.Device(s.device):
                        setattr(s, "graph2" if parity else "graph", s.stream.end_capture())
        for s in self.shards:
            with cp.cuda.Device(s.device):
                for g in (s.graph, s.graph2) if fixed else (s.graph,):
                    if hasattr(g, "upload"):
                        g.upload(s.stream)
        self._parity, self._pending = 0, None
        self.synchronize()
        log.info("captured one iteration as %d CUDA graph(s)%s", len(self.shards), " (two each: replays alternate)" if fixed else "")

    # --- Backend interface ---------------------------------------------------------------
    @property
    def pipelines(self) -> bool:
        """Whether the host may queue the next iteration before reading this one's times: yes, unless each
        iteration ends with a read of the fixed-point overflow flags (the deterministic one pass launched
        kernel by kernel), which waits for it anyway. Replayed, its flags are read one iteration late."""
        return self.graph or not self._fixed_point

    @property
    def _fixed_point(self) -> bool:
        """The deterministic one pass: 64-bit fixed-point sums, whose overflow flags the host reads."""
        return self.onepass and self.deterministic

    def iterate(self, f: Any, *, _eager: bool = False) -> Any:
        """One MLEM iteration on every GPU; returns the replicated image (a list, one array per GPU).

        Its events go into one of two sets per GPU, taken in turn, so that the times of the iteration before
        (:meth:`previous_step_times`) stay readable while this one runs."""
        cp = _cupy()
        self._adopt(f)
        self._times = {}
        for s in self.shards:
            s.events, s.prev_events = s.prev_events, s.events
            s.order, s.prev_order = [], s.order
        if self.graph and not _eager:
            fixed = self._fixed_point
            parity = self._parity if fixed else 0
            for s in self.shards:
                with cp.cuda.Device(s.device):
                    self._mark(s, "start", True)
                    (s.graph2 if parity else s.graph).launch(s.stream)
                    self._mark(s, "iteration", True)
            if fixed:  # a replay cannot retry: the replay before this one is checked now, while this one runs
                before, self._pending, self._parity = self._pending, parity, 1 - parity
                if before is not None:
                    self._check_replay(before, [(s, s.prev_events, s.prev_order) for s in self.shards], redo_next=True)
        else:
            self._settle()
            self._launch(record=True)
        return [s.f for s in self.shards]

    def _settle(self) -> None:
        """Read the overflow flags of the last replay if they are not read yet (and redo it if it overflowed):
        before anything reads the image, its times or launches kernel by kernel."""
        if self._pending is not None:
            last, self._pending = self._pending, None
            self._check_replay(last, [(s, s.events, s.order) for s in self.shards], redo_next=False)

    def _check_replay(self, parity: int, sets: list[tuple[Shard, dict, list]], *, redo_next: bool) -> None:
        """Read the flags of the replay of graph ``parity`` (its events in ``sets``). Where it overflowed: put
        back the image it started from, redo it kernel by kernel with a larger range (retrying as the eager
        path does), redo the replay queued after it (``redo_next``: it started from a wrong image) the same
        way, and capture the graphs again with that range."""
        bad = 0
        for s, events, order in sets:
            bad |= s.replay_flag(parity, events[order[-1]])
        if not bad:
            return
        self._pending = None
        for s in self.shards:
            s.put_back_image(s.befores[parity])
        self._fixed_bound *= FIXED_RETRY_FACTOR
        log.info("%s: overflow inside the CUDA graph (flag %d); iteration redone with the range raised to %.3g",
                 self.bp_kernel, bad, self._fixed_bound)
        self._launch(record=True)
        if redo_next:
            self._launch(record=True)
        self._capture()

    def _adopt(self, f: Any) -> None:
        """Make the shards' image buffers hold ``f`` (the graphs read those buffers)."""
        cp = _cupy()
        if isinstance(f, list) and len(f) == len(self.shards) and all(a is s.f for a, s in zip(f, self.shards)):
            return
        self._settle()
        arrs = f if isinstance(f, list) else [f] * len(self.shards)
        for s, a in zip(self.shards, arrs):
            with cp.cuda.Device(s.device), s.stream:
                if isinstance(a, np.ndarray):
                    s.f.set(np.asarray(a, dtype=np.float32), stream=s.stream)
                else:
                    s.f[...] = ck.to_device(a, s.device) if a.device.id != s.device else a

    def synchronize(self) -> None:
        """Wait for every shard's stream (and read the last replay's overflow flags where they are not read)."""
        self._settle()
        for s in self.shards:
            s.stream.synchronize()
        if self._peer is not None:
            self._peer.check()

    def last_step_times(self) -> dict[str, float]:
        """Seconds per step of the last iteration: for each step the slowest GPU's time.

        ``allreduce`` sums the all-reduces of the iteration (two in the
        thesis layout) and includes waiting for the slowest GPU to arrive.
        ``iteration`` is the longest GPU's span from its first to last event.
        """
        self._settle()
        if not self.shards or not self.shards[0].order:
            return dict(self._times)
        self._times = self._read_times([(s, s.events, s.order) for s in self.shards])
        return dict(self._times)

    def previous_step_times(self) -> dict[str, float] | None:
        """The step times of the iteration before the last (as :meth:`last_step_times`; None where there is
        none): read while the last one runs."""
        if not self.shards or not self.shards[0].prev_order:
            return None
        return self._read_times([(s, s.prev_events, s.prev_order) for s in self.shards])

    @staticmethod
    def _read_times(sets: list[tuple[Shard, dict, list]]) -> dict[str, float]:
        """Each step's slowest GPU and the longest GPU's span (``iteration``) from each GPU's recorded events
        (waits for the last of them)."""
        cp = _cupy()
        per: dict[str, float] = {}
        span = 0.0
        for s, events, order in sets:
            with cp.cuda.Device(s.device):
                events[order[-1]].synchronize()
                prev = events[order[0]]
                local: dict[str, float] = {}
                for name in order[1:]:
                    ev = events[name]
                    step = "allreduce" if name.startswith("allreduce") else name
                    local[step] = local.get(step, 0.0) + cp.cuda.get_elapsed_time(prev, ev) / 1e3
                    prev = ev
                span = max(span, cp.cuda.get_elapsed_time(events[order[0]], events[order[-1]]) / 1e3)
            for k, v in local.items():
                per[k] = max(per.get(k, 0.0), v)
        per["iteration"] = span
        return per

    def forward(self, f: Any) -> Any:
        """``A f`` gathered on the host (diagnostics; the iteration never calls it)."""
        self._settle()
        self._adopt(f)
        cp = _cupy()
        out = np.zeros(self.shape[0], dtype=np.float32)
        for s in self.shards:
            with cp.cuda.Device(s.device), s.stream:
                r0, r1 = s.rows
                y = cp.empty(r1 - r0, dtype=cp.float32)
                if self._kb.chunks:
                    cc.chunked_forward(s.a, s.f, y)
                else:
                    registry.launcher(self._k_forward)(s.a, s.f, y, lanes=self.lanes_fp, secsize=self.secsize)
                out[r0:r1] = y.get(stream=s.stream)
        return out

    def correlate(self, fp: Any) -> Any:
        """``g / fp`` on the host (diagnostics)."""
        raise NotImplementedError("cuda-nccl runs whole iterations: use iterate()")

    def back(self, c: Any) -> Any:
        raise NotImplementedError("cuda-nccl runs whole iterations: use iterate()")

    def update(self, f: Any, bp: Any) -> Any:
        raise NotImplementedError("cuda-nccl runs whole iterations: use iterate()")

    def initial_image(self) -> Any:
        self._settle()
        value = self._initial_value()
        cp = _cupy()
        for s in self.shards:
            with cp.cuda.Device(s.device), s.stream:
                s.f.fill(value)
        return [s.f for s in self.shards]

    def to_host(self, f: Any) -> np.ndarray:
        cp = _cupy()
        a = f[0] if isinstance(f, list) else f
        with cp.cuda.Device(a.device.id):
            self.synchronize()
            return np.asarray(a.get(), dtype=np.float32)

    def from_host(self, f: np.ndarray) -> Any:
        self._adopt(self._check_image(f, np.float32))
        return [s.f for s in self.shards]

    def close(self) -> None:
        """Release the GPUs' resources: wait for the streams, drop the graphs, destroy owned communicators.

        Idempotent; also run at interpreter exit (atexit) and by ``with``.
        The graphs go first: NCCL does not destroy a communicator while a
        CUDA graph that captured it exists.
        """
        if getattr(self, "_closed", True):
            return
        self._closed = True
        cp = _cupy()
        try:
            self.synchronize()
        except Exception as exc:  # a failed kernel must not stop the teardown
            log.warning("cuda-nccl close: %s", exc)
        for s in self.shards:
            s.graph = s.graph2 = None
        gc.collect()
        for s in self.shards:
            with cp.cuda.Device(s.device):
                cp.cuda.runtime.deviceSynchronize()
                if s.l2_window:
                    cc.release_l2()
        if self._owns_comms:
            for s in self.shards:
                if s.comm is not None:
                    s.comm.destroy()
        for s in self.shards:
            s.comm = None
        self.graph = False

    def __enter__(self) -> NcclBackend:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def writes_output(self) -> bool:
        """True on the process that should write results (part 0's owner)."""
        return any(s.part == 0 for s in self.shards)

    def describe(self) -> dict[str, Any]:
        from mlemlib.devices import device_facts

        devs = []
        for s in self.shards:
            try:
                facts = device_facts(s.device)
            except Exception as exc:  # NVML/CuPy trouble must not stop a run
                facts = {"error": str(exc)}
            devs.append({"index": s.device, "part": s.part, "rows": list(s.rows), "cols": list(s.cols), "nnz": s.nnz, **facts})
        steps = ["bp", "allreduce", "update"] if self.onepass else ["fp", "corr", "bp", "allreduce", "update"]
        if not self.onepass and self.layout == "local" and self._fused_fp:
            steps.remove("corr")
        if self.layout == "thesis" and self.fuse:
            steps.remove("update")
        return {
            "backend": self.name,
            "deterministic": self.deterministic,
            "fp": self.fp_kernel,
            "bp": self.bp_kernel,
            "layout": self.layout,
            "onepass": self.onepass,  # one read of A per iteration (timings.json's bytes)
            "l2_window": self.shards[0].l2_window if self.shards else None,  # every GPU's alike
            "gpus": self.world,
            "exchange": self.exchange,  # how the back projection is summed over the GPUs
            "graph": self.graph,
            "fused": self.fuse,
            "chunks": {"count": sum(s.a.chunks for s in self.shards), "reuse_sample": self.chunk_reuse_sample,
                       "file": self.chunk_file} if self._kb.chunks else None,
            "lanes_fp": self.lanes_fp,
            "lanes_bp": sorted({self.lanes_bp(s) for s in self.shards}) if self._kb.lanes and not self.onepass else None,
            "shape_fp": sorted({ck.shape_label(s.a) for s in self.shards}),
            "shape_bp": sorted({ck.shape_label(s.at) for s in self.shards if s.at is not None}),
            "transpose": ("none" if not self._kb.needs_transpose else "local parts")
            if self.layout == "local" else "row blocks",
            "format": self.format,
            # this process's blocks of A and A^T together
            "bytes_per_nnz": {"A": bytes_per_nnz(*(s.a for s in self.shards)),
                              "AT": bytes_per_nnz(*(s.at for s in self.shards))},
            "plan": self.plan,
            "nccl_version": self.nccl_version,
            "steps": steps if not self.graph else ["iteration"],
            "setup": getattr(self, "setup_record", None),
            "devices": devs,
        }


def graph_default(graph: bool | None, wanted: bool, graphable: bool) -> bool:
    """Whether a backend replays CUDA graphs: ``graph`` where given; None (``auto``): ``$MLEM_CUDA_GRAPH`` where
    set (1/true/yes/on, else off), otherwise where ``wanted`` (MLEM on several GPUs and OSEM on any count, whose graphs
    replace a launch per kernel, subset and GPU) and the kernels can be captured (``graphable``: none allocates)."""
    if graph is None:
        env = os.environ.get("MLEM_CUDA_GRAPH", "").strip().lower()
        if env:
            return env in ("1", "true", "yes", "on")
        return bool(wanted and graphable)
    return bool(graph)


def _close_at_exit(ref: weakref.ref) -> None:
    """atexit hook: close a backend still alive while CUDA still is (not from a destructor)."""
    be = ref()
    if be is not None:
        be.close()
