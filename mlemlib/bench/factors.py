"""The problem one benchmark row runs: ``g``, the norm, the background and the subsets, with synthetic factors (host only).

A case's ``factors`` (:data:`mlemlib.bench.cases.FACTORS`) decide what the
backend gets beside a prepared matrix (:class:`~mlemlib.bench.prepare.Prepared`):

- ``none`` — the prepared ``g`` and, for S = 1, the column sums ``norm.npy``;
  for S > 1 the update norms (:func:`mlemlib.subsets.update_norms`) of the
  subsets' sensitivities ``subset_norms.npy``; no background.
- ``synthetic`` — multiplicative factors ``m`` (:func:`synthetic_factors`:
  uniform in ``[0.2, 1.0)`` per stored row, 1% of them gaps with ``m = 0``,
  drawn from the case's seed) and an additive background ``b``, the same in
  every row: 20% of the mean of the trues ``m g``. The measurement is the
  noiseless ``m g + b``; the backend gets ``b' = b / m``
  (:func:`mlemlib.corrections.background`, ``+inf`` at a gap) and the
  sensitivities weighted by ``m`` (:func:`mlemlib.norm.sensitivities` through
  :func:`mlemlib.bench.prepare.subset_sensitivities`). They are made once per
  prepared matrix and seed and kept beside it (``factors-synthetic-<seed>.npz``).

The factors are drawn per stored row of each prepared matrix: the S = 1 and
S > 1 matrices hold their rows in different orders, so one LOR's ``m`` differs
between them while the values' distribution, the gaps' share and ``b`` are the
same (what the time depends on).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlemlib.bench.prepare import Prepared, subset_sensitivities

log = logging.getLogger(__name__)

#: The range of the synthetic multiplicative factors, the share of gaps (m = 0) and the background's share of
#: the mean trues.
M_RANGE = (0.2, 1.0)
GAP_FRACTION = 0.01
BACKGROUND_FRACTION = 0.2


@dataclass
class BenchProblem:
    """What :func:`mlemlib.backends.make_backend` gets for one row besides the matrix."""

    g: np.ndarray
    #: float64[n] (S = 1) or the (S, n) update norms of :func:`mlemlib.subsets.update_norms`.
    norm: np.ndarray
    #: ``b' = b / m`` per row (float32, ``+inf`` at a gap), or None.
    background: np.ndarray | None = None
    #: The S + 1 row bounds of the subsets, or None (S = 1).
    subsets: np.ndarray | None = None

    def backend_options(self) -> dict[str, Any]:
        """``background`` and ``subsets`` for ``make_backend`` where given (none for plain MLEM)."""
        out: dict[str, Any] = {}
        if self.background is not None:
            out["background"] = self.background
        if self.subsets is not None:
            out["subsets"] = self.subsets
        return out


def synthetic_factors(rows: int, seed: int) -> np.ndarray:
    """``m`` (float32[rows]): uniform in :data:`M_RANGE`, a :data:`GAP_FRACTION` of the rows 0, from ``seed``."""
    rng = np.random.default_rng(seed)
    m = rng.uniform(*M_RANGE, size=rows)
    m[rng.random(rows) < GAP_FRACTION] = 0.0
    return m.astype(np.float32)


def _synthetic(prep: Prepared, seed: int, bounds: np.ndarray) -> dict[str, np.ndarray]:
    """``g``, ``background`` and the m-weighted sensitivities of ``prep``'s matrix, cached beside it."""
    from mlemlib._io import atomic_path
    from mlemlib.corrections import background

    path = prep.directory / f"factors-synthetic-{seed}.npz"
    params = np.array([*M_RANGE, GAP_FRACTION, BACKGROUND_FRACTION, seed], dtype=np.float64)
    if path.exists():
        with np.load(path) as z:
            if np.array_equal(z["params"], params) and np.array_equal(z["bounds"], bounds):
                return {k: z[k] for k in ("g", "background", "sensitivities")}
    g0 = np.load(prep.g).astype(np.float64)
    m = synthetic_factors(g0.size, seed)
    trues = m.astype(np.float64) * g0
    b = np.full(g0.size, BACKGROUND_FRACTION * float(trues.mean()), dtype=np.float32)
    out = {
        "g": (trues + b).astype(np.float32),
        "background": background(m, b, g0.size),
        "sensitivities": subset_sensitivities(prep.matrix, bounds, m),
    }
    log.info("%s: synthetic factors (seed %d): %d gaps of %d rows, background %.4g per row", prep.directory.name,
             seed, int(np.count_nonzero(m == 0)), m.size, float(b[0]))
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        np.savez(fh, params=params, bounds=bounds, **out)
    return out


def bench_problem(prep: Prepared, factors: str = "none", seed: int = 0) -> BenchProblem:
    """The problem of one row: ``prep``'s matrix with ``factors`` (module docstring).

    Raises
    ------
    ValueError
        An unknown ``factors`` (the cases file has checked it).
    """
    from mlemlib.subsets import update_norms

    grouped = prep.subsets > 1
    bounds = np.load(prep.bounds) if grouped and prep.bounds is not None else None
    if factors == "none":
        g, norm = prep.load_problem()
        if bounds is not None:
            norm = update_norms(np.load(os.fspath(prep.subset_norms)))
        return BenchProblem(g, norm, None, bounds)
    if factors != "synthetic":
        raise ValueError(f"unknown factors {factors!r}")
    rows = int(np.load(prep.g, mmap_mode="r").shape[0])
    arrays = _synthetic(prep, seed, bounds if bounds is not None else np.array([0, rows], dtype=np.int64))
    sk = arrays["sensitivities"]
    norm = update_norms(sk) if bounds is not None else sk[0]
    return BenchProblem(arrays["g"], norm, arrays["background"], bounds)

