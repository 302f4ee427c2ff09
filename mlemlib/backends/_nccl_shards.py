"""What each GPU of the ``cuda-nccl`` backend holds (:class:`Shard`), and its loading (:func:`load_shard`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from mlemlib import registry
from mlemlib.backends import _compressed_cuda as cc
from mlemlib.backends import _cuda_kernels as ck
from mlemlib.backends.device_formats import device_type
from mlemlib.errors import ConfigError, MatrixFormatError

log = logging.getLogger("mlemlib.backends.nccl")


@dataclass
class Shard:
    """What one GPU holds and does.

    Field order is teardown order: the CUDA graph goes before the
    communicator (NCCL waits for graphs that captured a communicator to be
    destroyed before it destroys the communicator).
    """

    part: int
    device: int
    rows: tuple[int, int]
    cols: tuple[int, int]
    graph: Any = None
    graph2: Any = None  # a fixed-point one pass's second graph (its own image copy and flag; replays alternate)
    events: dict = field(default_factory=dict)
    order: list = field(default_factory=list)
    prev_events: dict = field(default_factory=dict)  # the iteration before the last's (a pipelined read)
    prev_order: list = field(default_factory=list)
    a: Any = None  # A_k (row pointer may start at an alignment pad, see rows_to_device)
    acc: Any = None  # onepass_fixed: the 64-bit fixed-point bp
    l2_window: dict | None = None  # the one pass's atomic target in L2 (_compressed_cuda.persist_in_l2)
    flag: Any = None  # onepass_fixed: overflow flag
    f_before: Any = None  # a fixed-point graph's copy of the image it starts from (an overflow puts it back)
    flags: list | None = None  # the two graphs' flags and image copies (graph, graph2)
    befores: list | None = None
    side: Any = None  # a stream that reads a replay's flag without waiting for the replays queued after it
    nnz: int = 0  # non-zeros of A_k (without padding)
    at: Any = None  # A_k^T (local) or rows cols of A^T (thesis); None for scatter
    smem: Any = None
    g: Any = None  # g_k (local) or g (thesis)
    bg: Any = None  # b' = b / m of the same rows as g (None: no background)
    norm: Any = None
    f: Any = None  # the replicated image (the all-reduce's receive buffer in thesis+fuse)
    c: Any = None
    fp: Any = None
    send: Any = None  # thesis: zero-padded FP of the block
    img_send: Any = None  # thesis: zero-padded image/bp block
    bp: Any = None
    comm: Any = None
    stream: Any = None

    def begin_capture(self, keep_image: bool) -> None:
        """Start capturing this GPU's stream into a CUDA graph; with ``keep_image`` (a fixed-point pass, which
        cannot retry inside a replay) the graph first copies the image it starts from into ``f_before``."""
        cp = ck.cupy()
        with cp.cuda.Device(self.device):
            if keep_image and self.f_before is None:
                self.f_before = cp.empty_like(self.f)
            self.stream.begin_capture()
            if keep_image:
                with self.stream:
                    self.f_before[...] = self.f

    def put_back_image(self, before: Any = None) -> None:
        """After a replay that overflowed: the image it started from (``before``, default ``f_before``) back into
        ``f``, on this GPU's stream (after any replay queued there)."""
        cp = ck.cupy()
        with cp.cuda.Device(self.device), self.stream:
            self.f[...] = self.f_before if before is None else before

    def replay_flag(self, parity: int, done: Any) -> int:
        """The overflow flag of the replay of graph ``parity`` (0: ``graph``, 1: ``graph2``), once the event
        ``done`` recorded after it has completed; read on a side stream, so that replays queued after it on
        this GPU's stream keep running."""
        cp = ck.cupy()
        with cp.cuda.Device(self.device):
            if self.side is None:
                self.side = cp.cuda.Stream(non_blocking=True)
            done.synchronize()
            return int(self.flags[parity].get(stream=self.side)[0])


def load_shard(be: Any, part: int, dev: int, *, matrix: Any, transpose: Any, plan_d: dict, g: Any, norm: Any,
               chunk_ranges: list | None, local_files: list | None, tune: bool, bg: Any = None,
               share: Shard | None = None) -> Shard:
    """Load plan part ``part`` onto GPU ``dev`` for the backend ``be`` (an :class:`~mlemlib.backends.nccl.NcclBackend`
    during its set-up): its rows of ``A`` in the backend's format (or its range of the chunk layout's chunks), its
    ``A_k^T`` (part file, or transposed on the GPU) or the thesis layout's rows of ``A^T``, the vectors of its
    layout, the launch shapes where tuned. The ``notrans`` selector is settled here on the first part (``be.bp_kernel``).
    ``bg``: the background per row of the whole matrix (None: none); each shard holds its rows' (all rows in the
    thesis layout). ``share``: the same GPU's shard of another backend whose stream, image buffer and
    scratch vectors (the back projection, the fixed point's accumulator) this one uses (the OSEM subsets'
    backends run one after the other on one stream and one image).
    """
    from mlemlib.formats import open_matrix

    cp = ck.cupy()
    m, n = be.shape
    layout = be.layout
    dev_type = device_type(be.format)
    r0, r1 = (int(v) for v in plan_d["rows"][part])
    if chunk_ranges is not None:
        r0, r1 = be._layout.rows_of(chunk_ranges[part])
    c0, c1 = (int(v) for v in plan_d["transpose_rows"][part]) if "transpose_rows" in plan_d else (0, n)
    s = Shard(part=part, device=dev, rows=(r0, r1), cols=(c0, c1))
    with cp.cuda.Device(dev):
        s.stream = share.stream if share is not None else cp.cuda.Stream(non_blocking=True)
        # Pad for csr_vector only (scatter kernels and cuSPARSE expect a row pointer from 0).
        no_t = not be._kb.needs_transpose
        pad_a = be._kf is not None and be._kf.shapes and not no_t
        if chunk_ranges is not None:  # the part's range of the layout's chunks
            s.a = cc.DeviceChunked.from_layout(be._layout, chunk_ranges[part], device=dev)
            s.nnz = int(s.a.nnz)
        elif be._kb.chunks:  # the row block as its own row chunks
            s.a = cc.DeviceChunked.upload(matrix, (r0, r1), device=dev, what=f"part {part}",
                                          sms=ck.device_properties(dev)["sm_count"])
            s.nnz = int(s.a.nnz)
        else:
            s.a = dev_type.upload(matrix, (r0, r1), device=dev, align=pad_a, fmt=be.format)
            s.nnz = int(s.a.nnz) if be.matrix_format.compressed else int(s.a.indptr[-1] - s.a.indptr[0])
        if layout == "thesis":
            s.at = dev_type.upload(transpose, (c0, c1), device=dev, align=be._kb.shapes,
                                   fmt=dev_type.transpose_format(transpose, be.format))
        elif not no_t:
            if local_files:
                with open_matrix(local_files[part]) as pf:
                    s.at = dev_type.upload(pf, (0, n), device=dev, fmt=dev_type.transpose_format(pf, be.format))
                if s.at.shape != (n, r1 - r0) or s.at.nnz != s.nnz:
                    raise MatrixFormatError(local_files[part], f"part is {s.at.shape} with {s.at.nnz} nnz, expected {(n, r1 - r0)} with {s.nnz}")
            elif not be.matrix_format.cusparse:
                raise ConfigError("plan", f"the local layout on a {be.format} matrix reads each GPU's "
                                  "A_k^T from the partition's part files (mlem partition); none given")
            else:
                plain = ck.unpadded(s.a)
                s.at = plain.transpose()  # cuSPARSE csr2csc on this GPU: A_k^T, rows sorted
                plain.drop_cusparse()
                del plain
        elif be._kb.smem:
            s.smem = ck.smem_plan(s.a)
            if be._kb.selector:  # settled on the first part, the same for all
                be.bp_kernel = registry.choose_notrans(s.smem.local_fraction)
                be._kb = registry.get_bp("cuda", be.bp_kernel)
                log.info("bp=notrans: %.0f%% of part %d's row chunks fit shared memory: %s",
                         100 * s.smem.local_fraction, part, be.bp_kernel)
            if not be._kb.smem:
                s.smem = None
        ck.set_row_layouts(s.a, s.at, be._kf is not None and be._kf.interleaved,
                           be._kb.interleaved, be.lanes_fp,
                           be.lanes_bp(s) if s.at is not None else 0)
        if tune and be._kf is not None and be._kf.shapes:
            s.a.tune(be.lanes_fp)
        if tune and s.at is not None and be._kb.shapes:
            s.at.tune(be.lanes_bp(s))
        s.norm = cp.asarray(norm, dtype=cp.float32)
        s.f = share.f if share is not None else cp.empty(n, dtype=cp.float32)
        if be.onepass and be.deterministic:
            shared_acc = share is not None and share.acc is not None
            s.acc = share.acc if shared_acc else cp.empty(n, dtype=cp.uint64)
            s.flag = cp.zeros(1, dtype=cp.int32)
        if bg is not None:
            s.bg = cp.asarray(bg[r0:r1] if layout == "local" else bg, dtype=cp.float32)
        if layout == "local":
            s.g = cp.asarray(g[r0:r1], dtype=cp.float32)
            s.c = cp.empty(r1 - r0, dtype=cp.float32)
            s.fp = s.c if be._fused_fp else cp.empty(r1 - r0, dtype=cp.float32)
            s.bp = share.bp if share is not None and share.bp is not None else cp.empty(n, dtype=cp.float32)
        else:
            s.g = cp.asarray(g, dtype=cp.float32)
            s.send = cp.zeros(m, dtype=cp.float32)
            s.fp = cp.empty(m, dtype=cp.float32)
            s.c = cp.empty(m, dtype=cp.float32)
            s.img_send = cp.zeros(n, dtype=cp.float32)
            s.bp = cp.empty(n, dtype=cp.float32)
        if be.onepass and not be._kb.chunks and be.matrix_format.compressed:  # atomic target in L2, as on one GPU
            s.l2_window = cc.persist_in_l2(s.stream, s.acc if be.deterministic else s.bp)
    return s
