"""OSEM on the GPUs: one :class:`~mlemlib.backends.nccl.NcclBackend` per subset, one image (CUDA only).

The subsets' rows are contiguous (the reorder stage groups them: :mod:`mlemlib.subsets`), so a subset
is a row range of the matrix, and a sub-iteration is an MLEM iteration over that range with the
subset's sensitivity. :class:`OsemBackend` builds, for each subset k, a backend over rows
``[bounds[k], bounds[k+1])`` whose P GPUs each hold an nnz-balanced share of those rows (the partition
stage's rule applied to the subset), with ``norm[k]`` (:func:`mlemlib.subsets.update_norms`: NaN where
the subset does not see a voxel, which the update then keeps). The S backends share their GPUs'
streams, image buffers and communicators: one :meth:`OsemBackend.iterate` launches the S
sub-iterations one after the other on each GPU's stream, with one all-reduce of the image's back
projection per subset (none on one GPU; over NVLink peer access for the fixed-point kernels, with the update
fused into it inside a graph: :mod:`mlemlib.backends._peer`); nothing is copied between them, and the back
projection's scratch vectors are one per GPU. With CUDA graphs the whole pass is one captured graph per GPU, and the
fixed point's overflow flags (one per subset, in one array per GPU) are read once after it.

Every kernel of the local layout runs in a subset (the stored-transpose pair transposes each GPU's
share of each subset on the GPU for CSR; a compressed matrix takes the one passes), with the
background ``b' = b / m`` where one is given; the deterministic kernels give the same bits for every
GPU count, as without subsets.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

import numpy as np

from mlemlib import setup_times
from mlemlib.backends._build import cupy
from mlemlib.backends._nccl_plan import indptr_of
from mlemlib.backends.base import FIXED_RETRY_FACTOR, Backend
from mlemlib.backends.nccl import graph_default
from mlemlib.errors import ConfigError
from mlemlib.matrix import shape_nnz

log = logging.getLogger(__name__)


def subset_plans(indptr: np.ndarray, bounds: np.ndarray, parts: int, n: int) -> list[dict]:
    """For each subset, the plan of ``parts`` GPUs over its rows (nnz-balanced; absolute row ranges).

    Each plan names the whole matrix's shape and nnz (what :func:`mlemlib.backends._nccl_plan.build_plan`
    checks) and parts that cover only the subset's rows.
    """
    from mlemlib import partition

    m, nnz = len(indptr) - 1, int(indptr[-1])
    plans = []
    for k in range(len(bounds) - 1):
        b0, b1 = int(bounds[k]), int(bounds[k + 1])
        sub = partition.make_plan(indptr[b0:b1 + 1] - indptr[b0], None, parts, (b1 - b0, n))
        plans.append({"parts": parts, "shape": [m, n], "nnz": nnz, "imbalance": sub["imbalance"],
                      "rows": [[b0 + int(r0), b0 + int(r1)] for r0, r1 in sub["rows"]],
                      "plan": f"<subset {k}: rows [{b0}, {b1})>"})
    return plans


class OsemBackend(Backend):
    """OSEM with S subsets on one or several GPUs of this process (module docstring).

    Parameters
    ----------
    matrix, g, norm
        As :class:`~mlemlib.backends.nccl.NcclBackend`; ``norm`` of shape (S, n) from
        :func:`mlemlib.subsets.update_norms`.
    subsets
        The S + 1 row bounds of the subsets (contiguous rows).
    background
        None or ``b' = b / m`` per row (:mod:`mlemlib.backends.base`).
    gpus, devices, layout
        The GPUs; the ``local`` layout only (the thesis layout's correlation of all rows has no subset form).
    kw
        The rest of :class:`~mlemlib.backends.nccl.NcclBackend`'s keywords (``fp``, ``bp``, ``graph``,
        ``tune``, ``lanes``...); ``graph`` None (``auto``) captures the pass as one graph per GPU on every GPU
        count where the kernels allow (a pass launches S times a step's kernels: on one GPU too, the launches
        cost more than a replay); ``False`` launches subset by subset; ``transpose``, ``plan`` and ``chunks`` describe the whole matrix and are
        not used (each subset's GPUs transpose or chunk their own rows).
    """

    name = "cuda-osem"

    @setup_times.records
    def __init__(self, matrix: Any, g: Any, norm: Any, transpose: Any | None = None, *, subsets: Any,
                 background: Any | None = None, gpus: int | None = None, devices: list[int] | None = None,
                 layout: str = "local", plan: Any | None = None, chunks: Any | None = None, **kw: Any) -> None:
        super().__init__()
        from mlemlib.backends.nccl import NcclBackend
        from mlemlib.formats import open_matrix

        if layout != "local":
            raise ConfigError("layout", f"OSEM subsets run in the local layout, not {layout!r} (its correlation "
                                        "spans every row)")
        if isinstance(matrix, (str, bytes)) or hasattr(matrix, "__fspath__"):
            matrix = open_matrix(matrix)
        (m, n), _ = shape_nnz(matrix)
        self.shape = (m, n)
        g, norm = self._check_problem(g, norm, (m, n))
        bounds = self._check_subsets(subsets, norm, (m, n))
        if bounds is None:
            raise ConfigError("subsets", "OsemBackend needs S > 1 subsets")
        norm = norm.reshape(len(bounds) - 1, n)
        ignored = [name for name, v in (("transpose", transpose), ("plan", plan), ("chunks", chunks)) if v is not None]
        if ignored:
            log.info("OSEM: %s describe the whole matrix; each subset's GPUs use their own rows",
                     ", ".join(ignored))
        devices = list(devices) if devices is not None else list(range(int(gpus or 1)))
        plans = subset_plans(indptr_of(matrix), bounds, len(devices), n)
        # _graphs before parts: where the backend is dropped without close(), its attributes go in this order,
        # and NCCL does not destroy a communicator (parts[0]'s) while a graph that captured it lives
        self._graphs: list[Any] | None = None
        self.bounds = bounds
        self.parts: list[Any] = []
        graph = kw.pop("graph", None)
        self.graph = False
        try:
            for k, p in enumerate(plans):
                share = self.parts[0] if self.parts else None
                self.parts.append(NcclBackend(matrix, g, norm[k], None, devices=devices, layout="local", plan=p,
                                              background=background, share=share, graph=False, **kw))
            first = self.parts[0]
            self.devices = devices
            self.deterministic = first.deterministic
            self.fp_kernel, self.bp_kernel = first.fp_kernel, first.bp_kernel
            self.load_seconds = sum(p.load_seconds for p in self.parts)
            self._share_flags()
            self.graph = graph_default(graph, True, all(p._graphable() for p in self.parts))
            if self.graph:
                with setup_times.phase("graph"):
                    self._capture()
        except BaseException:
            self.close()
            raise
        log.info("cuda-osem backend: %d subsets on %d GPU(s), fp=%s bp=%s (loaded in %.2f s)", len(plans),
                 len(devices), self.fp_kernel, self.bp_kernel, self.load_seconds)

    # --- the pass as one graph per GPU ------------------------------------------------------
    def _share_flags(self) -> None:
        """Give the subsets' fixed-point overflow flags one array per GPU (S entries), so that one read
        after a pass checks every subset."""
        cp = cupy()
        if not self.deterministic or self.parts[0].shards[0].flag is None:
            self._flags = None
            return
        self._flags = []
        for i, s0 in enumerate(self.parts[0].shards):
            with cp.cuda.Device(s0.device):
                flags = cp.zeros(len(self.parts), dtype=cp.int32)
            for k, p in enumerate(self.parts):
                p.shards[i].flag = flags[k:k + 1]
            self._flags.append(flags)

    def _capture(self) -> None:
        """Capture the S sub-iterations (kernels, all-reduces, updates) as one CUDA graph per GPU."""
        cp = cupy()
        for p in self.parts:
            if not p._graphable():
                raise ConfigError("graph", f"graph capture needs non-allocating kernels, not fp={p.fp_kernel} "
                                           f"bp={p.bp_kernel}")
        shards = self.parts[0].shards
        for s in shards:
            s.begin_capture(keep_image=self._flags is not None)  # an overflow puts the pass's start image back
        try:
            for p in self.parts:
                p.graph_capturing = True
                for t in p.shards:
                    t.order = []
                p._launch(record=False)
        finally:
            graphs = []
            for p in self.parts:
                p.graph_capturing = False
            for s in shards:
                with cp.cuda.Device(s.device):
                    graphs.append(s.stream.end_capture())
        for s, gr in zip(shards, graphs):
            with cp.cuda.Device(s.device):
                if hasattr(gr, "upload"):
                    gr.upload(s.stream)
        self._graphs = graphs
        self.synchronize()
        log.info("captured one OSEM pass (%d subsets) as %d CUDA graph(s)", len(self.parts), len(graphs))

    # --- Backend interface ---------------------------------------------------------------
    def iterate(self, f: Any) -> Any:
        """One OSEM iteration: the S sub-iterations in order, on the shared image (one array per GPU); with
        graphs one replay per GPU, then one read of each GPU's overflow flags."""
        if not (self.graph and self._graphs is not None):
            for p in self.parts:
                f = p.iterate(f)
            return f
        cp = cupy()
        first = self.parts[0]
        first._adopt(f)
        for s, gr in zip(first.shards, self._graphs):
            with cp.cuda.Device(s.device):
                s.order = []
                first._mark(s, "start", True)
                gr.launch(s.stream)
                first._mark(s, "iteration", True)
        for p in self.parts[1:]:
            for t in p.shards:
                t.order = []
        bad = np.zeros(len(self.parts), dtype=bool)
        for s, flags in zip(first.shards, self._flags or []):
            with cp.cuda.Device(s.device):
                bad |= flags.get(stream=s.stream) != 0
        if bad.any():
            self._pass_overflowed(np.flatnonzero(bad))
        return [s.f for s in first.shards]

    def sub_iterate(self, f: Any, k: int) -> Any:
        """Sub-iteration ``k`` alone, launched kernel by kernel (its subset's backend)."""
        return self.parts[k].iterate(f)

    def sub_step_times(self, k: int) -> dict[str, float]:
        return self.parts[k].last_step_times()

    def takes_image_step(self) -> bool:
        """Whether :meth:`set_image_step` works here (always: the subsets run in the local layout)."""
        return all(p.takes_image_step() for p in self.parts)

    def set_image_step(self, step: Any) -> None:
        """Run ``step`` (:class:`mlemlib._map_cuda.DeviceMapStep`) as the update of every sub-iteration (each
        subset's backend with its own norm); the pass's graphs are captured again with it."""
        self.synchronize()
        captured = self._graphs is not None
        self._graphs = None
        for p in self.parts:
            p.set_image_step(step)
        if captured:
            self._capture()

    def _pass_overflowed(self, subsets: np.ndarray) -> None:
        """A replayed pass overflowed in ``subsets``: put back the image it started from, raise those subsets'
        ranges, redo the pass subset by subset (each retrying as the eager path does) and capture it again."""
        first = self.parts[0]
        for s in first.shards:
            s.put_back_image()
        for k in subsets:
            self.parts[k]._fixed_bound *= FIXED_RETRY_FACTOR
        log.info("%s: overflow inside the pass's CUDA graph in subset(s) %s; pass redone with their ranges raised",
                 self.bp_kernel, ", ".join(str(int(k)) for k in subsets))
        f = [s.f for s in first.shards]
        for p in self.parts:
            f = p.iterate(f)
        self._capture()

    def last_step_times(self) -> dict[str, float]:
        """Seconds per step of the last iteration, summed over the subsets (each step the slowest GPU's);
        ``iteration`` is the longest GPU's span from the first subset's first event to the last one's last
        (with graphs only ``iteration``: a replay hides the steps)."""
        cp = cupy()
        per: dict[str, float] = {}
        last = self.parts[-1] if not (self.graph and self._graphs is not None) else self.parts[0]
        if last is not self.parts[0]:
            for p in self.parts:
                for k, v in p.last_step_times().items():
                    if k != "iteration":
                        per[k] = per.get(k, 0.0) + v
        span = 0.0
        for s0, s1 in zip(self.parts[0].shards, last.shards):
            if s0.order and s1.order:
                with cp.cuda.Device(s0.device):
                    end = s1.events[s1.order[-1]]
                    end.synchronize()  # a replayed pass without overflow flags has not been waited for
                    span = max(span, cp.cuda.get_elapsed_time(s0.events[s0.order[0]], end) / 1e3)
        per["iteration"] = span
        self._times = per
        return dict(per)

    def synchronize(self) -> None:
        self.parts[0].synchronize()

    def forward(self, f: Any) -> Any:
        raise ConfigError("subsets", "OSEM runs whole iterations (iterate); the forward projection is per subset")

    def correlate(self, fp: Any) -> Any:
        raise ConfigError("subsets", "OSEM runs whole iterations (iterate)")

    def back(self, c: Any) -> Any:
        raise ConfigError("subsets", "OSEM runs whole iterations (iterate)")

    def update(self, f: Any, bp: Any) -> Any:
        raise ConfigError("subsets", "OSEM runs whole iterations (iterate)")

    def initial_image(self) -> Any:
        """``sum(g) / sum(s)`` in every voxel (the subsets' sensitivities summed), on every GPU."""
        return self.parts[0].from_host(np.full(self.shape[1], self._initial_value(), dtype=np.float32))

    def to_host(self, f: Any) -> np.ndarray:
        return self.parts[0].to_host(f)

    def from_host(self, f: np.ndarray) -> Any:
        return self.parts[0].from_host(f)

    def use_graph(self, on: bool) -> None:
        """Replay the pass's graphs (True; captured now where not yet) or launch subset by subset (False)."""
        if on and self._graphs is None:
            self._capture()
        self.graph = bool(on)

    def close(self) -> None:
        """Drop the pass's graphs (NCCL keeps a communicator a graph captured), then close the subsets'
        backends, the first (which owns the communicators) last."""
        if getattr(self, "_graphs", None) is not None:
            self.synchronize()
            self._graphs = None
            gc.collect()
        for p in reversed(getattr(self, "parts", [])):
            p.close()

    def __enter__(self) -> OsemBackend:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def writes_output(self) -> bool:
        return self.parts[0].writes_output

    def describe(self) -> dict[str, Any]:
        out = self.parts[0].describe()
        if self.graph:
            out.update(graph=True, steps=["iteration"])
        out.update(backend=self.name, subsets=len(self.parts), setup=getattr(self, "setup_record", None),
                   subset_rows=[[int(self.bounds[k]), int(self.bounds[k + 1])] for k in range(len(self.parts))],
                   load_seconds=round(self.load_seconds, 3))
        return out
