"""The backend interface the MLEM loop drives (all backends).

A backend owns one MLEM problem on its device(s): the system matrix ``A``
(and, when stored, ``A^T``), the measurement ``g`` and the norm (column sums
of ``A``). The loop in :mod:`mlemlib.mlem` only calls :meth:`Backend.initial_image`,
:meth:`Backend.iterate`, :meth:`Backend.last_step_times` (and
:meth:`Backend.previous_step_times` where the backend pipelines, through
:func:`timed_iterations`) and :meth:`Backend.to_host`, so the CPU, one-GPU and
multi-GPU backends plug into the same loop.

One iteration follows the numerical contract of DESIGN.md::

    fp = A f
    c_i = g_i / fp_i            (0 where fp_i == 0)
    bp = A^T c
    f_j <- f_j * bp_j / norm_j  (f_j * bp_j where norm_j == 0)

With OSEM subsets and the corrections ``m`` and ``b`` every backend takes
the same two extra inputs (checked here, :meth:`Backend._check_subsets`,
:meth:`Backend._check_background`):

- ``background``: None, or ``b'_i = b_i / m_i`` per row (float32; ``+inf``
  where ``m_i = 0``, :func:`mlemlib.corrections.background`); then
  ``c_i = g_i / (fp_i + b'_i)``, 0 where ``fp_i + b'_i == 0``, which is the
  contract's ``m_i g_i / (m_i fp_i + b_i)`` (``m`` enters only through the
  sensitivities);
- ``subsets``: None (S = 1), or the S + 1 row bounds of subsets whose rows
  are contiguous; ``norm`` is then (S, n) from
  :func:`mlemlib.subsets.update_norms`, and one :meth:`Backend.iterate` is S
  sub-iterations in order, each ``f_j <- f_j`` where ``norm[k, j]`` is NaN,
  else as above with ``norm[k]`` over the subset's rows.
"""

from __future__ import annotations

import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from mlemlib.errors import ConfigError, SinogramFormatError

log = logging.getLogger(__name__)

#: The step names every backend reports, in order. Multi-GPU backends add "allreduce".
STEPS = ("fp", "corr", "bp", "update")


#: The deterministic one-pass kernels' fixed-point range: bp_j <= ONEPASS_C_MAX * max(norm), i.e. every
#: correlation g_i / fp_i below 2^20 (an overflow is detected and the iteration redone with a larger range).
ONEPASS_C_MAX = float(2**20)
#: A calibrated fixed-point range's headroom over the largest ``bp_j`` its first pass summed (:func:`calibrated_bound`).
FIXED_MARGIN = 2.0**8
#: Retries of a fixed-point iteration that overflowed, each with a range FIXED_RETRY_FACTOR times larger.
FIXED_RETRIES = 3
FIXED_RETRY_FACTOR = 2.0**20


def no_stored_transpose(bp: str, fmt: str) -> ConfigError:
    """The one line refusing ``bp`` (a back projection on ``A^T``) on a ``fmt`` matrix that a GPU cannot transpose
    itself, without a stored transpose."""
    return ConfigError("transpose", f"bp={bp} on a {fmt} matrix needs a stored transpose (mlem transpose), "
                                    "or use bp=onepass_fixed")


def calibrated_bound(top: int, scale: float, bound: float) -> float:
    """The fixed-point range of a deterministic one pass, chosen from what it sums.

    The range a backend starts with (``ONEPASS_C_MAX * max(norm)``) must hold
    every ``bp_j`` before anything is known of the data; its resolution,
    ``bound * 2^-52`` per term in the chunked kernel, is then coarse for the
    voxels of small sensitivity (an OSEM subset's, with attenuation, most of
    all). The backend's warm-up pass from the initial image sums its terms with
    that range; ``top`` is the largest of those sums (the fixed-point integers,
    after the all-reduce: the same on every GPU count and rerun) and ``scale``
    its scale. The range becomes :data:`FIXED_MARGIN` times the largest ``bp_j``
    (a power of two is taken by the kernels' scale), 2^12 (chunked) to 2^22
    times finer in practice; an iteration that outgrows it is flagged and redone
    with a larger range as before. ``bound`` is kept where the pass summed nothing.
    """
    top_bp = float(top) / float(scale) if scale else 0.0
    if not (top_bp > 0.0) or not np.isfinite(top_bp):
        return bound
    return min(bound, FIXED_MARGIN * top_bp)


def bytes_per_nnz(*mats: Any) -> float | None:
    """Bytes per stored non-zero of the matrices together (``describe()``'s ``bytes_per_nnz``); None if they hold none.

    ``None`` entries (a transpose not held) and empty matrices are left out.
    """
    held = [a for a in mats if a is not None and int(a.nnz)]
    return sum(int(a.nbytes) for a in held) / sum(int(a.nnz) for a in held) if held else None


def timed_iterations(be: Any, f: Any, first: int, last: int, *,
                     read_now: Callable[[int], bool] = lambda it: False) -> Iterator[tuple[int, Any, list]]:
    """Run iterations ``first .. last`` of ``be`` from image ``f``; yield ``(it, f, ready)`` after each.

    ``ready`` lists ``(k, step_times)`` of the iterations whose times were read
    at this point, in order. Where the backend pipelines (:attr:`Backend.pipelines`)
    iteration k's times are read after iteration k + 1 is queued, so that the
    device does not wait for the host between iterations; they are read at once
    after iteration ``it`` where ``read_now(it)`` (before a checkpoint, which
    synchronises anyway) and after the last. Otherwise each iteration's times
    are read right after it, with the host's wall time as ``iteration`` where
    the backend does not report one. (``mlem.reconstruct`` and ``bench`` both
    iterate through this, so that they time iterations the same way.)
    """
    pipelines = getattr(be, "pipelines", False)
    unread = False  # the previous iteration's times are not read yet (pipelining only)
    for it in range(first, last + 1):
        t0 = time.perf_counter()
        f = be.iterate(f)
        ready: list[tuple[int, dict[str, float]]] = []
        if not pipelines:
            step_times = dict(be.last_step_times())
            step_times.setdefault("iteration", time.perf_counter() - t0)
            ready.append((it, step_times))
        else:
            if unread:
                ready.append((it - 1, be.previous_step_times()))
            unread = not (read_now(it) or it == last)
            if not unread:
                ready.append((it, be.last_step_times()))
        yield it, f, ready


class Backend(ABC):
    """Base class of the MLEM backends.

    Subclasses implement the four steps on their own arrays and may override
    :meth:`iterate` to fuse steps or replay a captured CUDA graph; they must
    then still fill :attr:`_times` with the per-step times they measured (or
    the whole iteration under ``"iteration"``).

    Attributes
    ----------
    name
        ``"cpu"``, ``"cuda"``, ``"cuda-nccl"``...
    deterministic
        False when a step uses floating-point atomics (results may differ
        in the last bits run after run).
    shape
        ``(m, n)`` of the system matrix.
    """

    name: str = "base"
    deterministic: bool = True
    shape: tuple[int, int]

    def __init__(self) -> None:
        self._times: dict[str, float] = {}

    # --- the four steps ---------------------------------------------------
    @abstractmethod
    def forward(self, f: Any) -> Any:
        """Return ``A f`` (length m)."""

    @abstractmethod
    def correlate(self, fp: Any) -> Any:
        """Return ``c = g / fp`` elementwise, 0 where ``fp == 0``."""

    @abstractmethod
    def back(self, c: Any) -> Any:
        """Return ``A^T c`` (length n)."""

    @abstractmethod
    def update(self, f: Any, bp: Any) -> Any:
        """Return ``f * bp / norm`` (``f * bp`` where ``norm == 0``); may work in place."""

    # --- set-up and transfers ------------------------------------------------
    @abstractmethod
    def initial_image(self) -> Any:
        """Uniform image ``sum(g) / sum(norm)`` (sums in float64), on the backend's device."""

    @abstractmethod
    def to_host(self, f: Any) -> np.ndarray:
        """Copy an image to host memory as float32 (float64 in reference mode)."""

    @abstractmethod
    def from_host(self, f: np.ndarray) -> Any:
        """Put a host image (a checkpoint) on the backend's device."""

    # --- the problem checks every backend shares ------------------------------
    def _check_problem(self, g: Any, norm: Any, shape: tuple[int, int], *, float32: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Check ``g`` (length m) and the norm (length n) against ``shape``; keep their float64 sums.

        Sets :attr:`_g64sum` and :attr:`_norm64sum` (the initial image's
        numerator and denominator, summed in float64) and warns where counts
        above 2^24 are not exact in float32.

        Returns
        -------
        (g, norm)
            ``g`` as a flat host array (its own dtype) and the norm as float64.

        Raises
        ------
        SinogramFormatError
            ``g`` has not m values.
        ConfigError
            The norm has not n values.
        """
        m, n = (int(v) for v in shape)
        g = np.asarray(g).reshape(-1)
        if g.size != m:
            raise SinogramFormatError("<measurement>", f"{g.size} values but the matrix has m = {m} rows")
        norm = np.asarray(norm, dtype=np.float64)
        if norm.ndim != 2 or norm.shape[1] != n:  # (S, n) per subset, else one norm
            norm = norm.reshape(-1)
            if norm.size != n:
                raise ConfigError("norm", f"norm has {norm.size} values but the matrix has n = {n} columns")
        self._norm64sum = float(np.nansum(norm))  # update_norms' NaN (a kept voxel) counts nothing
        self._g64sum = float(np.sum(g, dtype=np.float64))
        if float32 and g.size and float(np.max(g)) > 2**24:
            log.warning("counts above 2^24 are not exact in float32 (max %g)", float(np.max(g)))
        return g, norm

    @staticmethod
    def _check_subsets(subsets: Any, norm: np.ndarray, shape: tuple[int, int]) -> np.ndarray | None:
        """The subsets' row bounds (int64[S+1]) checked against ``m`` and the norm's shape; None for S = 1.

        Call after :meth:`_check_problem`. S = 1 (None, or bounds ``[0, m]``) takes a norm of n values
        (or one row); S > 1 one of shape (S, n).

        Raises
        ------
        ConfigError
            Bounds that do not rise strictly from 0 to m, or a norm of another shape.
        """
        from mlemlib.subsets import check_bounds

        if subsets is None:
            if norm.ndim == 2:
                raise ConfigError("norm", f"norm has shape {norm.shape} (per subset) but no subsets were given")
            return None
        m, n = (int(v) for v in shape)
        bounds = check_bounds(subsets, m)
        s = len(bounds) - 1
        if (norm.shape if norm.ndim == 2 else (1, norm.size)) != (s, n):
            raise ConfigError("norm", f"norm has shape {norm.shape}, expected ({s}, n): one row per subset")
        return bounds

    @staticmethod
    def _check_background(background: Any, m: int, dtype: Any = np.float32) -> np.ndarray | None:
        """``b'`` as ``dtype``[m] (None stays None): no NaN, no negative value (``+inf`` marks a gap).

        float32 on every device; the float64 reference (``dtype`` float64) keeps a float64 ``b'``.
        """
        if background is None:
            return None
        b = np.asarray(background).reshape(-1)
        b = b.astype(np.float64 if np.dtype(dtype) == np.float64 and b.dtype == np.float64 else np.float32)
        if b.size != m:
            raise ConfigError("background", f"{b.size} values but the matrix has m = {m} rows")
        if np.isnan(b).any() or (b < 0).any():
            raise ConfigError("background", "holds NaN or a negative value (b / m: 0 or more, +inf at a gap)")
        return b

    def _check_one_subset(self, g: Any, norm: Any, subsets: Any | None, background: Any | None,
                          shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Check the measurement, norm, subsets and background of a backend that runs one subset (OSEM's
        subsets run through :class:`~mlemlib.backends.osem.OsemBackend`); ``(g, norm flat, b')`` on the host."""
        g, norm = self._check_problem(g, norm, shape)
        bounds = self._check_subsets(subsets, norm, shape)
        if bounds is not None and len(bounds) > 2:
            raise ConfigError("subsets", f"{type(self).__name__} runs one subset; OSEM runs through make_backend "
                                         "(OsemBackend)")
        return g, norm.reshape(-1), self._check_background(background, shape[0])

    def _initial_value(self) -> float:
        """``sum(g) / sum(norm)`` in float64, the value of every voxel of the first image."""
        if self._norm64sum <= 0:
            raise ConfigError("norm", "the norm (column sums of A) sums to zero: the matrix sees nothing")
        return self._g64sum / self._norm64sum

    def _check_image(self, f: np.ndarray, dtype: Any) -> np.ndarray:
        """A host image (a checkpoint) as a flat copy of ``dtype``, checked to have n values."""
        f = np.array(f, dtype=dtype, copy=True).reshape(-1)
        if f.size != self.shape[1]:
            raise ConfigError("image", f"image has {f.size} values, expected n = {self.shape[1]}")
        return f

    # --- timing --------------------------------------------------------------
    @contextlib.contextmanager
    def timer(self, step: str) -> Iterator[None]:
        """Time one step; the CPU uses a host clock, GPU backends override with CUDA events."""
        t0 = time.perf_counter()
        yield
        self._times[step] = self._times.get(step, 0.0) + time.perf_counter() - t0

    def iterate(self, f: Any) -> Any:
        """One MLEM iteration; per-step times land in :meth:`last_step_times`."""
        self._times = {}
        with self.timer("fp"):
            fp = self.forward(f)
        with self.timer("corr"):
            c = self.correlate(fp)
        with self.timer("bp"):
            bp = self.back(c)
        with self.timer("update"):
            f = self.update(f, bp)
        return f

    def last_step_times(self) -> dict[str, float]:
        """Seconds spent in each step of the last :meth:`iterate` (resolved; GPU backends synchronise here)."""
        return dict(self._times)

    def sub_iterate(self, f: Any, k: int) -> Any:
        """Sub-iteration ``k`` alone (EM's update over subset ``k``'s rows), for an algorithm that acts between
        sub-iterations (:mod:`mlemlib.map`); its times are :meth:`sub_step_times`. A backend of one subset
        (S = 1) runs :meth:`iterate`; backends with subsets override it."""
        if k != 0:
            raise ConfigError("subsets", f"sub-iteration {k} of a backend with one subset")
        return self.iterate(f)

    def sub_step_times(self, k: int) -> dict[str, float]:
        """Seconds per step of the last :meth:`sub_iterate` ``k``."""
        return self.last_step_times()

    #: Whether :meth:`previous_step_times` reads an iteration's times while the next one runs
    #: (backends that time with events on a queue: a loop that reads its times one iteration
    #: late keeps the device busy instead of letting it wait for the host between iterations).
    pipelines: bool = False

    def previous_step_times(self) -> dict[str, float] | None:
        """Seconds per step of the iteration before the last :meth:`iterate` (None where there is
        none, or where the backend does not keep them: :attr:`pipelines` is False)."""
        return None

    def synchronize(self) -> None:
        """Wait until the device has finished all work queued so far (the CPU works synchronously: nothing to do)."""

    def describe(self) -> dict[str, Any]:
        """Facts for ``timings.json``: backend, kernels, device, deterministic."""
        return {"backend": self.name, "deterministic": self.deterministic}
