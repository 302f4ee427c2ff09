"""OSEM on the GPUs: one :class:`~mlemlib.backends.nccl.NcclBackend` per subset, one image (CUDA only).

The subsets' rows are contiguous (the reorder stage groups them: :mod:`mlemlib.subsets`), so a subset
is a row range of the matrix, and a sub-iteration is an MLEM iteration over that range with the
subset's sensitivity. :class:`OsemBackend` builds, for each subset k, a backend over rows
``[bounds[k], bounds[k+1])`` whose P GPUs each hold an nnz-balanced share of those rows (the partition
stage's rule applied to the subset), with ``norm[k]`` (:func:`mlemlib.subsets.update_norms`: NaN where
the subset does not see a voxel, which the update then keeps). The S backends share their GPUs'
streams, image buffers and communicators: one :meth:`OsemBackend.iterate` launches the S
sub-iterations one after the other on each GPU's stream, with one all-reduce of the image's back
projection per subset; nothing is copied between them. With CUDA graphs each sub-iteration is one
captured graph per GPU.

Every kernel of the local layout runs in a subset (the stored-transpose pair transposes each GPU's
share of each subset on the GPU for CSR; a compressed matrix takes the one passes), with the
background ``b' = b / m`` where one is given; the deterministic kernels give the same bits for every
GPU count, as without subsets.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from mlemlib.backends._build import cupy
from mlemlib.backends._nccl_plan import indptr_of
from mlemlib.backends.base import Backend
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
        ``tune``, ``lanes``...); ``transpose``, ``plan`` and ``chunks`` describe the whole matrix and are
        not used (each subset's GPUs transpose or chunk their own rows).
    """

    name = "cuda-osem"

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
        self.bounds = bounds
        self.parts: list[Any] = []
        try:
            for k, p in enumerate(plans):
                share = self.parts[0] if self.parts else None
                self.parts.append(NcclBackend(matrix, g, norm[k], None, devices=devices, layout="local", plan=p,
                                              background=background, share=share, **kw))
        except BaseException:
            self.close()
            raise
        first = self.parts[0]
        self.devices = devices
        self.deterministic = first.deterministic
        self.fp_kernel, self.bp_kernel = first.fp_kernel, first.bp_kernel
        self.load_seconds = sum(p.load_seconds for p in self.parts)
        log.info("cuda-osem backend: %d subsets on %d GPU(s), fp=%s bp=%s (loaded in %.2f s)", len(plans),
                 len(devices), self.fp_kernel, self.bp_kernel, self.load_seconds)

    # --- Backend interface ---------------------------------------------------------------
    def iterate(self, f: Any) -> Any:
        """One OSEM iteration: the S sub-iterations in order, on the shared image (one array per GPU)."""
        for p in self.parts:
            f = p.iterate(f)
        return f

    def last_step_times(self) -> dict[str, float]:
        """Seconds per step of the last iteration, summed over the subsets (each step the slowest GPU's);
        ``iteration`` is the longest GPU's span from the first subset's first event to the last one's last."""
        cp = cupy()
        per: dict[str, float] = {}
        for p in self.parts:
            for k, v in p.last_step_times().items():
                if k != "iteration":
                    per[k] = per.get(k, 0.0) + v
        span = 0.0
        for s0, s1 in zip(self.parts[0].shards, self.parts[-1].shards):
            if s0.order and s1.order:
                with cp.cuda.Device(s0.device):
                    span = max(span, cp.cuda.get_elapsed_time(s0.events[s0.order[0]], s1.events[s1.order[-1]]) / 1e3)
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
        for p in self.parts:
            p.use_graph(on)

    def close(self) -> None:
        """Close the subsets' backends, the first (which owns the communicators) last."""
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
        out.update(backend=self.name, subsets=len(self.parts),
                   subset_rows=[[int(self.bounds[k]), int(self.bounds[k + 1])] for k in range(len(self.parts))],
                   load_seconds=round(self.load_seconds, 3))
        return out
