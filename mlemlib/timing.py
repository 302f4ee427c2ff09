"""Host-side timing helpers: a stopwatch, per-step sample collection, statistics (all backends).

The MLEM loop collects one sample per iteration and step (``fp``, ``corr``,
``bp``, ``update``, ``allreduce`` and the whole ``iteration``) in a
:class:`StepTimes`; :func:`stats` reduces a list of samples to the figures the
thesis reports (mean, min, max) plus median, standard deviation and total.

GPU backends measure their steps with CUDA events (in
:mod:`mlemlib.backends.cuda`) and hand the resolved seconds to the same
collector, so the statistics are computed in one place for every backend.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping

import numpy as np

#: Order in which step statistics are listed (unknown steps follow, sorted).
STEP_ORDER = ("iteration", "fp", "corr", "bp", "update", "allreduce")


def stats(samples: Iterable[float]) -> dict[str, float | int]:
    """Reduce timing samples (seconds) to summary statistics.

    Parameters
    ----------
    samples
        Seconds, one per iteration (or per repetition).

    Returns
    -------
    dict
        ``n``, ``mean``, ``min``, ``max``, ``median``, ``std`` (population
        standard deviation) and ``total``, in seconds; the figures are NaN and
        ``n`` is 0 when there are no samples.
    """
    a = np.asarray(list(samples), dtype=np.float64)
    if a.size == 0:
        nan = math.nan
        return {"n": 0, "mean": nan, "min": nan, "max": nan, "median": nan, "std": nan, "total": 0.0}
    return {
        "n": int(a.size),
        "mean": float(a.mean()),
        "min": float(a.min()),
        "max": float(a.max()),
        "median": float(np.median(a)),
        "std": float(a.std()),
        "total": float(a.sum()),
    }


def ordered_steps(names: Iterable[str]) -> list[str]:
    """Step names in :data:`STEP_ORDER`, unknown ones after, sorted."""
    names = set(names)
    known = [s for s in STEP_ORDER if s in names]
    return known + sorted(names - set(STEP_ORDER))


class StepTimes:
    """Collects per-iteration step times.

    Every :meth:`add` call appends one iteration; a step missing from an
    iteration (a backend that fused it into another) is simply not sampled.
    """

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {}

    def add(self, times: Mapping[str, float]) -> None:
        """Record the step times (seconds) of one iteration."""
        for step, seconds in times.items():
            self.samples.setdefault(step, []).append(float(seconds))

    def __len__(self) -> int:
        it = self.samples.get("iteration")
        if it is not None:
            return len(it)
        return max((len(v) for v in self.samples.values()), default=0)

    def mean(self, step: str = "iteration") -> float:
        """Mean seconds of one step so far (NaN without samples)."""
        s = self.samples.get(step, [])
        return float(np.mean(s)) if s else math.nan

    def summary(self) -> dict[str, dict[str, float | int]]:
        """Statistics (see :func:`stats`) of every step, in :data:`STEP_ORDER`."""
        return {step: stats(self.samples[step]) for step in ordered_steps(self.samples)}

    def to_json(self) -> dict[str, list[float]]:
        """The raw samples, in :data:`STEP_ORDER`, for ``timings.json``."""
        return {step: list(self.samples[step]) for step in ordered_steps(self.samples)}


class Stopwatch:
    """Context manager measuring wall-clock seconds with :func:`time.perf_counter`.

    Examples
    --------
    >>> with Stopwatch() as sw:
    ...     pass
    >>> sw.seconds >= 0
    True
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self._t0 = 0.0

    def __enter__(self) -> Stopwatch:  # noqa: PYI034 - final in practice; Self needs 3.11 typing only
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._t0


def format_seconds(seconds: float) -> str:
    """Human-readable duration in the thesis's units: ``2.09212 s``, ``16.498 ms``, ``3.200 us``."""
    if seconds is None or not math.isfinite(seconds):
        return "n/a"
    a = abs(seconds)
    if a >= 1.0:
        return f"{seconds:.4f} s"
    if a >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.3f} us"
