"""Float64 references of MAP reconstruction for small problems (host; NumPy + SciPy): the ground truth of the tests.

Provides

- :class:`MapProblem` — ``A`` (a SciPy sparse matrix), the counts ``g``, the
  factors ``m`` and background ``b`` (``ybar = m (A f) + b``) and a
  :class:`~mlemlib.prior.Prior`; :func:`objective` —
  ``Phi(f) = sum_i [g_i log ybar_i - ybar_i] - beta R(f)``, the
  log-likelihood and ``R``, all in float64.
- :func:`solve_map` — the maximiser of ``Phi`` over ``f >= 0`` with SciPy's
  L-BFGS-B (bounds ``f >= 0``), to high accuracy: independent of the
  algorithms below and of every backend.
- :func:`bsrem` and :func:`osl` — the two MAP algorithms in float64 on a
  SciPy matrix, subsets as contiguous row ranges, returning the image and
  ``Phi``, the log-likelihood and ``R`` per pass (:class:`History`): what the
  real backends are checked against.

The prior's value and gradient here are computed from the explicit list of
neighbour pairs (:func:`mlemlib.prior.neighbour_pairs`) with NumPy, not with the
stencil kernels of :mod:`mlemlib.prior`, so that each checks the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlemlib.errors import ConfigError
from mlemlib.prior import Prior, neighbour_pairs

#: Default relaxation of BSREM: ``lambda_n = lambda_0 / (1 + n / eta)`` for pass ``n = 0, 1, ...``.
DEFAULT_RELAXATION = (1.0, 10.0)
#: Default floor of BSREM's preconditioner, relative to the initial image's value: ``(f + delta) / s``.
DEFAULT_FLOOR = 1e-3


class PairPrior:
    """``R``, ``dR/df`` of a :class:`~mlemlib.prior.Prior` from its explicit pair list (float64, NumPy).

    Parameters
    ----------
    prior
        The prior (in the caller's voxel order, as the images given to the methods).
    """

    def __init__(self, prior: Prior) -> None:
        j, k, w = neighbour_pairs(prior.grid)
        if prior.inv is not None:  # user voxels -> the caller's
            j, k = prior.inv[j], prior.inv[k]
        c = w.copy()
        if prior.kappa is not None:
            kap = prior.kappa.astype(np.float64)
            c *= kap[j] * kap[k]
        self.prior, self.j, self.k, self.c, self.n = prior, j, k, c, prior.n

    def _terms(self, f: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        a, b = f[self.j], f[self.k]
        d = a - b
        if self.prior.kind == "quadratic":
            return 0.5 * d * d, d, -d
        den = a + b + self.prior.gamma * np.abs(d) + self.prior.epsilon
        s = np.sign(d)
        phi = d * d / den
        # d phi / da and d phi / db from the quotient rule (dD/da = 1 + gamma sign d, dD/db = 1 - gamma sign d)
        da = 2 * d / den - d * d * (1 + self.prior.gamma * s) / den**2
        db = -2 * d / den - d * d * (1 - self.prior.gamma * s) / den**2
        return phi, da, db

    def value(self, f: np.ndarray) -> float:
        """``R(f)`` in float64."""
        phi, _, _ = self._terms(np.asarray(f, dtype=np.float64))
        return float(np.sum(self.c * phi))

    def gradient(self, f: np.ndarray) -> np.ndarray:
        """``dR/df`` in float64."""
        _, da, db = self._terms(np.asarray(f, dtype=np.float64))
        return np.bincount(self.j, self.c * da, self.n) + np.bincount(self.k, self.c * db, self.n)


@dataclass
class MapProblem:
    """A small MAP problem in float64.

    Attributes
    ----------
    A
        SciPy sparse system matrix (m x n), made CSR float64.
    g
        Counts, m values ``>= 0``.
    mult, add
        Per-LOR factors ``m`` (default 1) and background ``b`` (default 0), ``ybar = m (A f) + b``.
    prior
        The prior (its ``beta``), or None for the plain log-likelihood.
    """

    A: Any
    g: np.ndarray
    mult: np.ndarray | None = None
    add: np.ndarray | None = None
    prior: Prior | None = None
    _pairs: PairPrior | None = field(default=None, init=False, repr=False)
    _blocks: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        import scipy.sparse as sp

        self.A = sp.csr_matrix(self.A, dtype=np.float64)
        m, n = self.A.shape
        self.g = _vector(self.g, m, "g")
        self.mult = np.ones(m) if self.mult is None else _vector(self.mult, m, "m")
        self.add = np.zeros(m) if self.add is None else _vector(self.add, m, "b")
        if self.prior is not None:
            if self.prior.n != n:
                raise ConfigError("prior.grid", f"{self.prior.n} voxels, the matrix has n = {n}")
            self._pairs = PairPrior(self.prior)

    @property
    def beta(self) -> float:
        """The prior's ``beta`` (0 without a prior)."""
        return 0.0 if self.prior is None else float(self.prior.beta)

    def block(self, rows: slice) -> tuple[Any, Any]:
        """``(A_rows, A_rows^T)`` as CSR (cut once per row range and kept)."""
        key = (rows.start, rows.stop)
        got = self._blocks.get(key)
        if got is None:
            a = self.A[rows]
            got = self._blocks[key] = (a, a.T.tocsr())
        return got

    def sensitivity(self, rows: slice = slice(None)) -> np.ndarray:
        """``s_j = sum_{i in rows} a_ij m_i`` (float64)."""
        return np.asarray(self.block(rows)[1] @ self.mult[rows]).reshape(-1)

    def ybar(self, f: np.ndarray, rows: slice = slice(None)) -> np.ndarray:
        """``m (A f) + b`` over ``rows``."""
        return self.mult[rows] * (self.block(rows)[0] @ f) + self.add[rows]

    def back(self, y: np.ndarray, rows: slice = slice(None)) -> np.ndarray:
        """``A_rows^T y`` (``y`` over ``rows``)."""
        return np.asarray(self.block(rows)[1] @ y).reshape(-1)

    def prior_value(self, f: np.ndarray) -> float:
        """``R(f)`` (0 without a prior)."""
        return 0.0 if self._pairs is None else self._pairs.value(f)

    def prior_gradient(self, f: np.ndarray) -> np.ndarray:
        """``dR/df`` (zeros without a prior)."""
        return np.zeros(self.A.shape[1]) if self._pairs is None else self._pairs.gradient(f)

    def initial(self) -> np.ndarray:
        """The usual first image: ``sum(g) / sum(s)`` where ``s > 0``, 0 where ``s == 0``."""
        s = self.sensitivity()
        return np.where(s > 0, self.g.sum() / s.sum(), 0.0)


def _vector(v: Any, m: int, name: str) -> np.ndarray:
    a = np.asarray(v, dtype=np.float64).reshape(-1)
    if a.size != m:
        raise ConfigError(name, f"{a.size} values, expected {m} (the matrix's rows)")
    if not np.isfinite(a).all() or (a < 0).any():
        raise ConfigError(name, "holds NaN, Inf or negative values")
    return a


def log_likelihood(problem: MapProblem, f: np.ndarray) -> float:
    """``sum_i [g_i log ybar_i - ybar_i]`` (terms with ``g_i == 0`` are ``-ybar_i``; ``-inf`` where ``ybar_i = 0 < g_i``)."""
    y = problem.ybar(np.asarray(f, dtype=np.float64))
    g = problem.g
    pos = g > 0
    with np.errstate(divide="ignore"):
        return float(np.sum(g[pos] * np.log(y[pos])) - np.sum(y))


def objective(problem: MapProblem, f: np.ndarray) -> tuple[float, float, float]:
    """``(Phi, log-likelihood, R)`` at ``f``, in float64."""
    L = log_likelihood(problem, f)
    R = problem.prior_value(np.asarray(f, dtype=np.float64))
    return L - problem.beta * R, L, R


def gradient(problem: MapProblem, f: np.ndarray, rows: slice = slice(None)) -> np.ndarray:
    """``grad L_rows(f) = A_rows^T (m g / ybar - m)`` over ``rows`` (0 where ``ybar == 0``), float64."""
    y = problem.ybar(f, rows)
    m = problem.mult[rows]
    ratio = np.divide(problem.g[rows], y, out=np.zeros_like(y), where=y > 0)
    return problem.back(m * ratio - m, rows)


def solve_map(
    problem: MapProblem,
    f0: np.ndarray | None = None,
    *,
    gtol: float = 1e-11,
    maxiter: int = 50000,
    polish: bool = True,
) -> np.ndarray:
    """The maximiser of ``Phi`` over ``f >= 0`` (L-BFGS-B on ``-Phi``, bounds ``[0, inf)``, float64).

    The variables are scaled by the initial image's level so that the
    tolerances are relative; ``Phi`` is divided by ``sum(g)``. Voxels with zero
    sensitivity are fixed at 0 (as every algorithm here and in the backends keeps them).

    Parameters
    ----------
    problem
        The problem (``ybar > 0`` wherever ``g > 0`` for every ``f >= 0``, e.g. ``b > 0`` on LORs that count).
    f0
        Starting image (default :meth:`MapProblem.initial`).
    gtol, maxiter
        L-BFGS-B's projected-gradient tolerance (on the scaled problem) and its iteration limit.
    polish
        Follow L-BFGS-B with Newton steps on the positive voxels (images of at most
        :data:`POLISH_MAX_VOXELS` voxels): the largest gradient component falls from about 1e-7 of the
        initial one to rounding, the image's error from about 1e-6 to about 1e-12.

    Returns
    -------
    numpy.ndarray
        float64[n].
    """
    from scipy.optimize import minimize

    f0 = problem.initial() if f0 is None else np.asarray(f0, dtype=np.float64)
    s = problem.sensitivity()
    scale = float(f0[s > 0].mean()) if (s > 0).any() else 1.0
    norm = max(float(problem.g.sum()), 1.0)
    fixed = s == 0

    def fun(x: np.ndarray) -> tuple[float, np.ndarray]:
        f = x * scale
        phi, _, _ = objective(problem, f)
        grad = gradient(problem, f) - problem.beta * problem.prior_gradient(f)
        return -phi / norm, -grad * scale / norm

    bounds = [(0.0, 0.0) if fx else (0.0, None) for fx in fixed]
    res = minimize(fun, f0 / scale, jac=True, method="L-BFGS-B", bounds=bounds,
                   options={"maxiter": maxiter, "maxfun": 2 * maxiter, "ftol": 1e-16, "gtol": gtol, "maxcor": 30})
    f = np.maximum(res.x, 0.0) * scale
    return _newton_polish(problem, f, ~fixed) if polish and f.size <= POLISH_MAX_VOXELS else f


#: Largest image :func:`solve_map` polishes with Newton steps (a dense Hessian).
POLISH_MAX_VOXELS = 4096


def _newton_polish(problem: MapProblem, f: np.ndarray, live: np.ndarray, steps: int = 20) -> np.ndarray:
    """Newton steps on the voxels with ``f > 0``: L-BFGS-B stops where ``Phi``'s rounding hides its progress
    (a relative gradient of about 1e-7); Newton steps drive the analytic gradient down to rounding.

    The likelihood's Hessian is exact (``-A^T diag(m^2 g / ybar^2) A``), the prior's is the central difference
    of its analytic gradient. A step is shortened to keep ``f >= 0`` and taken only while it reduces the
    largest gradient component of the free voxels.
    """
    def grad_phi(x: np.ndarray) -> np.ndarray:
        return gradient(problem, x) - problem.beta * problem.prior_gradient(x)

    g = grad_phi(f)
    for _ in range(steps):
        free = np.flatnonzero(live & (f > 0))
        if free.size == 0:
            break
        now = float(np.abs(g[free]).max())
        y = problem.ybar(f)
        w = np.divide(problem.mult**2 * problem.g, y * y, out=np.zeros_like(y), where=y > 0)
        Af = problem.A[:, free].toarray()
        H = -(Af.T * w) @ Af
        if problem.beta > 0:
            h = 1e-6 * float(f[free].max())
            for col, j in enumerate(free):
                e = np.zeros_like(f)
                e[j] = h
                dg = problem.prior_gradient(f + e)[free] - problem.prior_gradient(f - e)[free]
                H[:, col] -= problem.beta * dg / (2 * h)
        try:
            step = -np.linalg.solve(H, g[free])
        except np.linalg.LinAlgError:
            break
        neg = step < 0
        t = min(1.0, 0.99 * float(np.min(f[free][neg] / -step[neg]))) if neg.any() else 1.0
        trial = f.copy()
        trial[free] = f[free] + t * step
        g_trial = grad_phi(trial)
        if not float(np.abs(g_trial[free]).max()) < now:
            break
        f, g = trial, g_trial
    return f


@dataclass
class History:
    """``Phi``, the log-likelihood and ``R`` of the initial image (entry 0) and after each pass (entry ``n``)."""

    phi: list[float] = field(default_factory=list)
    loglik: list[float] = field(default_factory=list)
    prior: list[float] = field(default_factory=list)

    def record(self, problem: MapProblem, f: np.ndarray) -> None:
        phi, L, R = objective(problem, f)
        self.phi.append(phi)
        self.loglik.append(L)
        self.prior.append(R)


def _subset_slices(subsets: Any, m: int) -> list[slice]:
    bounds = np.asarray(subsets, dtype=np.int64).reshape(-1)
    if bounds.size < 2 or bounds[0] != 0 or bounds[-1] != m or (np.diff(bounds) <= 0).any():
        raise ConfigError("subsets", f"row bounds {bounds.tolist()} must rise strictly from 0 to m = {m}")
    return [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def bsrem(
    problem: MapProblem,
    subsets: Any,
    passes: int,
    *,
    relaxation: tuple[float, float] = DEFAULT_RELAXATION,
    floor: float = DEFAULT_FLOOR,
    f0: np.ndarray | None = None,
    average: bool = False,
    halving: tuple[int, ...] = (),
) -> tuple[np.ndarray, History]:
    """BSREM (block sequential regularised EM) in float64: converges to the maximiser of ``Phi`` over ``f >= 0``.

    The formulation of De Pierro & Yamagishi (2001) and Ahn & Fessler (2003),
    as SIRF's and the PETRIC challenge's BSREM: a relaxed, preconditioned,
    projected gradient ascent on the subset objectives
    ``Phi_k = L_k - beta R / S`` taken in turn, for sub-iteration ``k`` of pass ``n``:

        f <- max(0, f + lambda_n * (f + delta) / s * (S grad L_k(f) - beta grad R(f)))

    with ``s`` the sensitivity (all subsets; the preconditioner ``(f + delta) / s``
    is EM's: with ``beta = 0``, ``b = 0`` and balanced subsets, ``lambda = 1``
    and ``delta = 0`` it is OSEM), ``S`` the number of subsets and the relaxation
    ``lambda_n = lambda_0 / (1 + n / eta)``, constant within a pass. The
    relaxation going to 0 with ``sum lambda_n`` infinite makes the subset
    iterations converge to the maximiser (Ahn & Fessler 2003); unrelaxed
    (``eta = inf``) they approach a limit cycle, as OSEM. Non-negativity is
    kept by the projection ``max(0, .)``; the floor ``delta`` (default
    ``1e-3`` of the initial image's value, as SIRF's BSREM) keeps the
    preconditioner positive so that a voxel that reaches 0 can rise again
    (with ``delta = 0`` it would stay at 0 for ever). Voxels with ``s_j = 0``
    stay 0.

    Parameters
    ----------
    problem
        The problem.
    subsets
        Row bounds ``[0, r_1, ..., m]``: subset ``k`` is rows ``[r_k, r_{k+1})``.
    passes
        Passes over all subsets.
    relaxation
        ``(lambda_0, eta)``, default ``(1, 10)``: ``lambda_0 > 0``, ``eta > 0`` (``inf``: no relaxation).
    floor
        ``delta`` relative to the initial image's mean over voxels with ``s > 0``, ``>= 0``.
    f0
        Initial image (default :meth:`MapProblem.initial`).
    average
        Each pass gives the mean of its S sub-iterates instead of the last one (the sub-iterations go on from
        the last): the returned image and the ``History`` are the means'.
    halving
        The passes after which the sub-iterations per pass halve, each then covering the rows of two
        neighbouring subsets of the one before (``S`` a multiple of ``2 ** len(halving)``).

    Returns
    -------
    (numpy.ndarray, History)
        The image (float64[n]) and ``Phi``, the log-likelihood and ``R`` per pass.
    """
    lam0, eta = (float(v) for v in relaxation)
    if not (lam0 > 0 and eta > 0) or not np.isfinite(lam0):
        raise ConfigError("relaxation", f"({lam0}, {eta}), expected lambda_0 > 0 and eta > 0")
    if not (floor >= 0 and np.isfinite(floor)):
        raise ConfigError("floor", f"{floor}, expected a finite number >= 0")
    m = problem.A.shape[0]
    slices = _subset_slices(subsets, m)
    S = len(slices)
    if S % (1 << len(halving)):
        raise ConfigError("halving", f"{len(halving)} halvings of {S} subsets")
    s = problem.sensitivity()
    live = s > 0
    f = (problem.initial() if f0 is None else np.asarray(f0, dtype=np.float64).copy())
    f[~live] = 0.0
    delta = floor * (float(f[live].mean()) if live.any() else 0.0)
    precond = np.zeros_like(s)
    hist = History()
    hist.record(problem, f)
    out = f
    for n in range(passes):
        lam = lam0 / (1.0 + n / eta)
        iterates = []
        size = 2 ** sum(1 for p in halving if n >= p)
        merged = [slice(slices[j].start, slices[j + size - 1].stop) for j in range(0, S, size)]
        for rows in merged:
            step = len(merged) * gradient(problem, f, rows) - problem.beta * problem.prior_gradient(f)
            np.divide(f + delta, s, out=precond, where=live)
            f = np.maximum(0.0, f + lam * precond * step)
            f[~live] = 0.0
            iterates.append(f)
        out = np.mean(iterates, axis=0) if average else f
        hist.record(problem, out)
    return out, hist


def osl(
    problem: MapProblem, subsets: Any, passes: int, *, f0: np.ndarray | None = None
) -> tuple[np.ndarray, History]:
    """Green's one-step-late (OSL) EM with subsets, in float64: fast, but it does not converge with subsets.

    Sub-iteration ``k`` (rows of subset ``k``, ``S`` subsets):

        f_j <- f_j * (sum_{i in S_k} a_ij m_i g_i / ybar_i) / (s^k_j + beta dR/df_j(f) / S)

    the prior's gradient at the current image ("one step late") and divided by
    ``S`` as the subset objective ``L_k - beta R / S`` has it (STIR's OSMAPOSL
    does the same); with ``S = 1`` it is Green's (1990) OSL. ``f_j`` is kept
    where the denominator is ``<= 0`` (a large ``beta`` against a steep
    neighbourhood) and where ``s^k_j = 0``; ``f_j = 0`` where ``s_j = 0``.
    With one subset a fixed point is a stationary point of ``Phi``, but there
    is no convergence guarantee (it diverges for large ``beta``); with several
    subsets the iterates approach a limit cycle off the maximiser, as OSEM's,
    and stay there: use :func:`bsrem` for the maximiser.

    Parameters
    ----------
    problem, subsets, passes, f0
        As for :func:`bsrem`.

    Returns
    -------
    (numpy.ndarray, History)
        The image and ``Phi``, the log-likelihood and ``R`` per pass.
    """
    slices = _subset_slices(subsets, problem.A.shape[0])
    S = len(slices)
    s = problem.sensitivity()
    sk = [problem.sensitivity(rows) for rows in slices]
    f = (problem.initial() if f0 is None else np.asarray(f0, dtype=np.float64).copy())
    f[s == 0] = 0.0
    hist = History()
    hist.record(problem, f)
    for _ in range(passes):
        for rows, s_k in zip(slices, sk):
            y = problem.ybar(f, rows)
            c = problem.mult[rows] * np.divide(problem.g[rows], y, out=np.zeros_like(y), where=y > 0)
            back = problem.back(c, rows)
            den = s_k + problem.beta * problem.prior_gradient(f) / S
            ok = (den > 0) & (s_k > 0)
            f = np.where(ok, f * back / np.where(ok, den, 1.0), f)
        hist.record(problem, f)
    return f, hist


__all__ = [
    "DEFAULT_FLOOR",
    "DEFAULT_RELAXATION",
    "History",
    "MapProblem",
    "PairPrior",
    "bsrem",
    "gradient",
    "log_likelihood",
    "objective",
    "osl",
    "solve_map",
]
