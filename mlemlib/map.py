"""MAP reconstruction: BSREM and OSL with the relative difference or quadratic prior, on every backend.

The objective (maximised over ``f >= 0``)::

    Phi(f) = sum_i [g_i log(ybar_i) - ybar_i] - beta R(f),     ybar = m (A f) + b

with ``R`` the prior of :mod:`mlemlib.prior`. MAP is a term of the model and
an algorithm, not a backend: :class:`MapBackend` wraps any backend (CPU, one
GPU, N GPUs, every kernel family). Where the backend takes an image step (the
GPU backends with subsets or several GPUs), the step below is its update,
on its streams and inside its CUDA graph (:mod:`mlemlib._map_cuda`), written
from ``bp_k``. Elsewhere each pass runs as the S sub-iterations the wrapped
backend offers (:meth:`mlemlib.backends.base.Backend.sub_iterate`), each
followed by one elementwise step over the image in the backend's own array
namespace (NumPy or CuPy). Every GPU applies the same step to the same sums, so
deterministic kernels stay bit-identical over GPU counts. A sub-iteration of the wrapped
backend is EM's: ``f_EM = f * bp_k / s_k`` (``f`` kept where ``s_k = 0``),
``bp_k = A_k^T (m g / ybar)``; from it, with ``grad = dR/df`` at ``f``:

- **BSREM** (De Pierro and Yamagishi 2001, Ahn and Fessler 2003): the
  relaxed, preconditioned gradient step on the subset objective
  ``L_k - beta R / S`` with the preconditioner ``f / s``::

      f <- max(nu, f + lambda_n (f / s) (S (bp_k - s_k) - beta grad))
         = max(nu, f + lambda_n (S (s_k / s) (f_EM - f) - beta f grad / s))

  ``lambda_n = lambda_0 / (1 + n / eta)`` in pass ``n`` (from 0; defaults 1 and
  10); the relaxation going to 0 with an infinite sum makes the iterates
  converge to the maximiser of ``Phi``. ``nu`` (1e-5 of the initial image's
  value) keeps every voxel positive, so that one the step pushes to the bound
  can rise again (EM's preconditioner is 0 at 0); voxels that no LOR sees
  (``s = 0``) are 0. With ``preconditioner="hessian"`` the preconditioner is
  ``f / (s + beta f H)``, ``H`` the diagonal of the prior's Hessian at ``f``
  (:meth:`mlemlib.prior.Prior.curvature`): the step above divided by
  ``1 + beta f H / s``. A ``preconditioner_offset`` ``o`` puts ``f + delta``,
  ``delta = o f_0`` (``f_0`` the initial image's value), in place of ``f`` in
  either preconditioner: voxels of low activity (cold regions), whose steps
  ``f / s`` makes small, converge faster; the iterates still converge to the
  maximiser (any positive, bounded diagonal preconditioner does).
- **OSL** (Green's one-step-late OSEM): ``f <- f_EM s_k / (s_k + beta grad / S)``
  (``f_EM`` where the denominator is not positive or ``s_k = 0``). Fast, but
  with subsets it does not converge to the maximiser.

``Phi``, the log-likelihood (up to the constant ``-sum log g_i!``, over the rows
with ``m > 0``) and ``R`` are recorded per pass (:attr:`MapBackend.history`),
from the host image: on the CPU with the backend's own forward projection, on
the GPUs with a float64 host copy of the stored matrix (matrices up to
:data:`OBJECTIVE_NNZ_MAX` non-zeros; none for a larger one).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlemlib.errors import ConfigError
from mlemlib.subsets import sensitivities_of

log = logging.getLogger(__name__)

#: The algorithms and their defaults.
ALGORITHMS = ("bsrem", "osl")
PRECONDITIONERS = ("em", "hessian")
#: What image a BSREM pass gives: ``last`` (its last sub-iterate) or ``pass`` (the mean of its S sub-iterates).
AVERAGING = ("last", "pass")
DEFAULT_RELAXATION = (1.0, 10.0)
#: BSREM's positivity bound, relative to the initial image's value.
FLOOR = 1e-5
#: Matrices with more stored non-zeros record no Phi per pass (it is computed on the host).
OBJECTIVE_NNZ_MAX = 300_000_000


@dataclass(frozen=True)
class MapSettings:
    """A MAP run: the prior (``rdp`` or ``quadratic``), its parameters and the algorithm."""

    prior: str
    beta: float
    gamma: float = 2.0
    epsilon: float | None = None
    kappa: Any = None
    algorithm: str = "bsrem"
    relaxation: tuple[float, float] = DEFAULT_RELAXATION
    #: BSREM's preconditioner: ``em`` (``f / s``) or ``hessian`` (``f / (s + beta f H)``, ``H`` the diagonal of the
    #: prior's Hessian at ``f``).
    preconditioner: str = "em"
    #: ``delta`` of BSREM's preconditioner, relative to the initial image's value: ``f`` in it becomes
    #: ``f + delta`` (0: the preconditioner as named), so that voxels of low activity take larger steps.
    preconditioner_offset: float = 0.0
    #: BSREM's image of a pass: ``last``, its last sub-iterate, or ``pass``, the mean of its S sub-iterates (the
    #: iteration itself goes on from the last one): the mean cancels most of the subsets' limit cycle.
    averaging: str = "last"
    #: BSREM's subset schedule: the passes after which the number of sub-iterations per pass halves, each
    #: one then covering two neighbouring subsets of the one before (S, S / 2 after pass ``p_1``, S / 4 after
    #: ``p_2``, ...; empty: S in every pass). Fewer subsets late shrink the subsets' limit cycle.
    subset_halving: tuple[int, ...] = ()

    def check(self) -> MapSettings:
        """Validate (one-line :class:`ConfigError` naming ``prior.<key>`` or ``algorithm``); return self."""
        from mlemlib.prior import KINDS

        if self.prior not in KINDS:
            raise ConfigError("prior.type", f"{self.prior!r}, expected one of {', '.join(KINDS)}")
        if self.algorithm not in ALGORITHMS:
            raise ConfigError("algorithm", f"{self.algorithm!r}, expected one of {', '.join(ALGORITHMS)}")
        if self.preconditioner not in PRECONDITIONERS:
            raise ConfigError("preconditioner", f"{self.preconditioner!r}, expected one of {', '.join(PRECONDITIONERS)}")
        if self.averaging not in AVERAGING:
            raise ConfigError("averaging", f"{self.averaging!r}, expected one of {', '.join(AVERAGING)}")
        if self.averaging != "last" and self.algorithm != "bsrem":
            raise ConfigError("averaging", f"{self.averaging!r} is BSREM's; {self.algorithm} gives its last sub-iterate")
        halving = check_halving_passes(self.subset_halving)
        if halving and self.algorithm != "bsrem":
            raise ConfigError("subset_halving", f"is BSREM's; {self.algorithm} runs every subset in every pass")
        lam, eta = (float(v) for v in self.relaxation)
        if not (lam > 0 and math.isfinite(lam)) or not eta > 0:
            raise ConfigError("relaxation", f"lambda_0 and eta must be > 0, got {self.relaxation}")
        offset = float(self.preconditioner_offset)
        if not (math.isfinite(offset) and offset >= 0):
            raise ConfigError("preconditioner_offset", f"must be a finite number >= 0, got {self.preconditioner_offset}")
        if not (math.isfinite(float(self.beta)) and float(self.beta) >= 0):
            raise ConfigError("prior.beta", f"must be >= 0, got {self.beta}")
        if not (math.isfinite(float(self.gamma)) and float(self.gamma) >= 0):
            raise ConfigError("prior.gamma", f"must be a finite number >= 0, got {self.gamma}")
        if self.prior == "rdp" and (self.epsilon is None or not 0 < float(self.epsilon) < math.inf):
            raise ConfigError("prior.epsilon", f"the relative difference prior needs epsilon > 0, got {self.epsilon} "
                                               "(about 1e-3 of the image's mean value in the object)")
        return self

    def identity(self) -> str:
        """What the settings change of the problem (its fingerprint's part)."""
        kappa = "" if self.kappa is None else (str(self.kappa) if isinstance(self.kappa, (str, bytes)) or
                                               hasattr(self.kappa, "__fspath__") else "<array>")
        eta = float(self.relaxation[1])
        return (f"map={self.algorithm}:{self.prior}:beta={float(self.beta)!r}:gamma={float(self.gamma)!r}:"
                f"epsilon={None if self.epsilon is None else float(self.epsilon)!r}:kappa={kappa}:"
                f"relax={float(self.relaxation[0])!r},{eta!r}" + (
                    "" if self.preconditioner == "em" else f":precond={self.preconditioner}") + (
                    f":offset={float(self.preconditioner_offset)!r}" if self.preconditioner_offset else "") + (
                    "" if self.averaging == "last" else f":average={self.averaging}") + (
                    f":halve={','.join(str(int(p)) for p in self.subset_halving)}" if self.subset_halving else ""))

    def record(self) -> dict[str, Any]:
        """``timings.json``'s account of the settings."""
        return {"algorithm": self.algorithm, "prior": self.prior, "beta": float(self.beta), "gamma": float(self.gamma),
                "epsilon": None if self.epsilon is None else float(self.epsilon),
                "kappa": None if self.kappa is None else str(self.kappa), "relaxation": list(self.relaxation),
                "preconditioner": self.preconditioner, "preconditioner_offset": float(self.preconditioner_offset),
                "averaging": self.averaging, "subset_halving": [int(p) for p in self.subset_halving]}


def check_halving_passes(halving: Any, what: str = "subset_halving") -> tuple[int, ...]:
    """The passes after which the subsets halve (increasing integers >= 1, a list or tuple), or one line naming
    ``what``."""
    if not isinstance(halving, (tuple, list)) or any(
            isinstance(p, bool) or not isinstance(p, (int, np.integer)) or p < 1 for p in halving) or any(
            b <= a for a, b in itertools.pairwise(halving)):
        raise ConfigError(what, f"passes after which the subsets halve: increasing integers >= 1, got {halving!r}")
    return tuple(int(p) for p in halving)


def check_halving(halving: Any, subsets: int, what: str = "subset_halving") -> None:
    """Refuse (one line naming ``what``) a subset schedule that ``subsets`` cannot follow: S must halve once per
    entry into whole subsets (S divisible by 2 to the number of entries)."""
    if halving and int(subsets) % (1 << len(halving)):
        raise ConfigError(what, f"{len(halving)} halvings of {int(subsets)} subsets: S must be divisible by "
                                f"{1 << len(halving)}")


def group_size(halving: Any, done: int) -> int:
    """The subsets each sub-iteration of the pass after ``done`` passes covers: 1 before the first halving, 2
    after it, ..."""
    return 1 << sum(1 for p in halving if done >= int(p))


def pass_groups(halving: Any, subsets: int, done: int) -> list[range]:
    """The sub-iterations of the pass after ``done`` passes: each a range of neighbouring subsets whose rows it
    covers (:func:`group_size` of them)."""
    size = group_size(halving, done)
    return [range(k, k + size) for k in range(0, int(subsets), size)]


def _xp(a: Any) -> Any:
    """The array's namespace: CuPy for a CuPy array, else NumPy."""
    if type(a).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


class MapBackend:
    """A backend running MAP passes: each of the wrapped backend's sub-iterations followed by the MAP step.

    Parameters
    ----------
    inner
        The backend of the problem (``subsets`` as its norm says), built for MLEM/OSEM.
    settings
        The MAP settings (validated).
    prior
        The :class:`mlemlib.prior.Prior` in the backend's voxel order.
    norm
        The problem's norm: (n,) for S = 1, or the (S, n) update norms (NaN: kept in that sub-iteration).
    objective
        ``(f_host) -> (Phi, L, R)`` or None: evaluated after every pass (``every_pass``) or only on request.
    """

    def __init__(self, inner: Any, settings: MapSettings, prior: Any, norm: np.ndarray, *,
                 objective: Any = None, every_pass: bool = True) -> None:
        self.inner = inner
        self.settings = settings.check()
        self.prior = prior
        sk, s, inv_s = sensitivities_of(norm)
        self.subsets = sk.shape[0]
        check_halving(self.settings.subset_halving, self.subsets)
        self._host = {"sk": sk, "s": s, "inv_s": inv_s}
        self._dev: dict[Any, dict[str, Any]] = {}
        self.objective = objective
        self.every_pass = every_pass
        self.passes = 0
        self.history: list[dict[str, float]] = []
        self._times: dict[str, float] = {}
        bsrem = self.settings.algorithm == "bsrem"
        f0 = float(inner._initial_value()) if bsrem else 0.0
        #: BSREM's positivity bound (None for OSL) and whether its preconditioner holds the prior's curvature.
        self._floor = FLOOR * f0 if bsrem else None
        self._hessian = bsrem and self.settings.preconditioner == "hessian"
        #: BSREM's preconditioner offset ``delta`` in image units (0: none).
        self._delta = float(self.settings.preconditioner_offset) * f0
        #: Whether a pass's image is the mean of its sub-iterates (:meth:`output_image`), and the last pass's
        #: ``(iterate, mean)``: the iteration goes on from the iterate, the mean is what the pass gives.
        self._average = bsrem and self.settings.averaging == "pass"
        self._output: tuple[Any, Any] | None = None
        #: The step on the GPUs' streams as the wrapped backend's update (:mod:`mlemlib._map_cuda`), or None:
        #: the step runs here between the sub-iterations.
        self.device_step = None
        if callable(getattr(inner, "takes_image_step", None)) and inner.takes_image_step():
            from mlemlib._map_cuda import DeviceMapStep

            halving = self.settings.subset_halving
            self.device_step = DeviceMapStep(self.settings.algorithm, prior, float(self.settings.beta), norm,
                                             self._floor or 0.0, hessian=self._hessian, offset=self._delta,
                                             average=self._average,
                                             groups=[group_size(halving, int(p)) for p in (0, *halving)])
            inner.set_image_step(self.device_step)
        elif self.subsets > 1 and hasattr(inner, "use_graph") and getattr(inner, "graph", False):
            inner.use_graph(False)  # the passes run subset by subset (the MAP step between them)
        self.shape = inner.shape

    # --- the per-device constants ---------------------------------------------------------
    def _consts(self, f: Any) -> dict[str, Any]:
        xp = _xp(f)
        key = (xp.__name__, getattr(getattr(f, "device", None), "id", None))
        c = self._dev.get(key)
        if c is None:
            dt = f.dtype
            sk, s, inv_s = self._host["sk"], self._host["s"], self._host["inv_s"]
            with _device(f):
                c = {"s": xp.asarray(s.astype(dt)), "sk": [xp.asarray(v.astype(dt)) for v in sk],
                     "ratio": [xp.asarray(np.divide(self.subsets * v, s, out=np.zeros_like(s), where=s > 0).astype(dt))
                               for v in sk],
                     "inv_s": xp.asarray(inv_s.astype(dt)), "seen": xp.asarray(s > 0)}
            self._dev[key] = c
        return c

    def _images(self, f: Any) -> list[Any]:
        return list(f) if isinstance(f, list) else [f]

    # --- the pass ------------------------------------------------------------------------
    def iterate(self, f: Any) -> Any:
        """One MAP pass: S sub-iterations of the wrapped backend, each followed by the MAP step."""
        t0 = time.perf_counter()
        lam0, eta = (float(v) for v in self.settings.relaxation)
        lam = lam0 / (1.0 + self.passes / eta)
        beta = float(self.settings.beta)
        if self.device_step is not None:  # the whole pass on the GPUs (one graph replay where captured)
            group = group_size(self.settings.subset_halving, self.passes)
            if group != self.device_step.group:  # the subsets halve: a value the pass's launches read on the GPUs
                self.device_step.set_group(group)
                log.info("BSREM: %d sub-iterations per pass from pass %d", self.subsets // group, self.passes + 1)
            self.device_step.set_relaxation(lam)
            f = self.inner.iterate(f)
            self.passes += 1
            self._times = dict(self.inner.last_step_times())
            self._output = (f, self.device_step.mean_of(f)) if self._average else None
            if self.objective is not None and self.every_pass:
                self.record_objective(self.output_image(f))
            return f
        inner_times: dict[str, float] = {}
        t_prior = 0.0
        total: list[Any] = []  # the sum of the pass's sub-iterates (averaging)
        groups = pass_groups(self.settings.subset_halving, self.subsets, self.passes)
        for q, group in enumerate(groups):
            tp = time.perf_counter()
            before = []
            for img in self._images(f):
                with _device(img):
                    if beta and self._hessian:
                        grad, curv = self.prior.gradient_and_curvature(img)
                    else:
                        grad, curv = (self.prior.gradient(img) if beta else None), None
                    before.append((img.copy(), grad, curv))
                    _synchronize(img)
            t_prior += time.perf_counter() - tp
            # each subset's EM image from the same image: the first in f itself, the others in copies of it
            ems = []
            for j, k in enumerate(group):
                start = [prev.copy() for prev, _, _ in before] if j else None
                em = self.inner.sub_iterate(f if j == 0 else start if isinstance(f, list) else start[0], k)
                for step, v in self.inner.sub_step_times(k).items():
                    inner_times[step] = inner_times.get(step, 0.0) + v
                if j == 0:
                    f = em
                else:
                    ems.append(self._images(em))
            # the backend runs on streams of its own: its sub-iterations are done before the step reads them,
            # and the step is done before the next sub-iteration starts
            self.inner.synchronize()
            tp = time.perf_counter()
            for i, (img, (prev, grad, curv)) in enumerate(zip(self._images(f), before)):
                with _device(img):
                    self._step(img, prev, grad, curv, list(group), lam, beta, [e[i] for e in ems])
                    if self._average:
                        if q == 0:
                            total.append(img.copy())
                        else:
                            total[i] += img
                    _synchronize(img)
            t_prior += time.perf_counter() - tp
        self.passes += 1
        self.inner.synchronize()
        if self._average:
            for a in total:
                with _device(a):
                    a /= a.dtype.type(len(groups))
                    _synchronize(a)
            self._output = (f, total if isinstance(f, list) else total[0])
        self._times = {**inner_times, "map": t_prior, "iteration": time.perf_counter() - t0}
        if self.objective is not None and self.every_pass:
            self.record_objective(self.output_image(f))
        return f

    def output_image(self, f: Any) -> Any:
        """The image of the pass that returned ``f``: the mean of its sub-iterates with ``averaging: pass``
        (in ``f``'s form, on its devices), else ``f`` itself (also for an image no pass here returned)."""
        if self._output is not None and self._output[0] is f:
            return self._output[1]
        return f

    def _step(self, f: Any, prev: Any, grad: Any, curv: Any, ks: list[int], lam: float, beta: float,
              more: list[Any] = ()) -> None:
        """The MAP step in place: ``f`` holds ``f_EM`` of subset ``ks[0]``'s sub-iteration from ``prev`` and
        ``more`` those of the other subsets ``ks[1:]`` a halved pass's sub-iteration covers, from the same
        ``prev``; ``grad`` and ``curv`` the prior's gradient and curvature at ``prev`` (None: no prior, or the
        EM preconditioner)."""
        xp = _xp(f)
        c = self._consts(f)
        k = ks[0]
        if self.settings.algorithm == "bsrem":
            step = c["ratio"][k] * (f - prev)  # (f / s) S (bp_k - s_k) = (S s_k / s) (f_EM - f)
            if more:  # (f / s) (S / g) sum_k (bp_k - s_k) over the g subsets of the sub-iteration
                for kk, em in zip(ks[1:], more):
                    step += c["ratio"][kk] * (em - prev)
                step /= f.dtype.type(len(ks))
            pa = prev  # f of the preconditioner, or f + delta
            if self._delta:  # ((f + delta) / s) S (bp_k - s_k): the step above times (f + delta) / f
                pa = prev + f.dtype.type(self._delta)
                step *= pa / xp.maximum(prev, f.dtype.type(self._floor))
            if grad is not None:
                step -= beta * pa * grad * c["inv_s"]
                if curv is not None:  # f / (s + beta f H) = (f / s) / (1 + beta f H / s)
                    step /= 1 + beta * pa * curv * c["inv_s"]
            new = prev + lam * step
            xp.maximum(new, f.dtype.type(self._floor), out=new)
            f[...] = xp.where(c["seen"], new, 0)
        elif grad is not None:  # OSL
            sk = c["sk"][k]
            den = sk + (beta / self.subsets) * grad
            ok = (sk > 0) & (den > 0)
            f[...] = xp.where(ok, f * sk / xp.where(ok, den, 1), f)

    def record_objective(self, f: Any) -> dict[str, float]:
        """Evaluate and append ``Phi``, ``L`` and ``R`` of image ``f`` (this pass's)."""
        phi, ll, r = self.objective(self.inner.to_host(f))
        entry = {"pass": self.passes, "phi": phi, "log_likelihood": ll, "prior": r}
        self.history.append(entry)
        return entry

    # --- the rest of the interface: the wrapped backend's ---------------------------------
    def resume_at(self, passes: int) -> None:
        """The run goes on from a checkpoint written after ``passes`` passes: the relaxation continues from there."""
        self.passes = int(passes)
        self._output = None

    def initial_image(self) -> Any:
        self.passes = 0
        self.history = []
        self._output = None
        f = self.inner.initial_image()
        if self.objective is not None and self.every_pass:
            self.record_objective(f)
        return f

    def last_step_times(self) -> dict[str, float]:
        return dict(self._times)

    def previous_step_times(self) -> None:
        return None

    pipelines = False
    #: No graph to sample kernel by kernel after the run (that would run passes of MAP's own state).
    graph = False

    def __getattr__(self, name: str) -> Any:  # to_host, from_host, synchronize, close, writes_output, ...
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def describe(self) -> dict[str, Any]:
        d = dict(self.inner.describe())
        d["map"] = {**self.settings.record(), "step": "device" if self.device_step is not None else "host"}
        if self.device_step is None:
            d["graph"] = False
        return d


def _synchronize(a: Any) -> None:
    """Wait for the work queued on the current stream of a CuPy array's device (nothing for NumPy)."""
    if type(a).__module__.startswith("cupy"):
        import cupy

        cupy.cuda.get_current_stream().synchronize()


class _device:
    """The CUDA device of a CuPy array as a context (nothing for NumPy)."""

    def __init__(self, a: Any) -> None:
        self.ctx = a.device if type(a).__module__.startswith("cupy") else None

    def __enter__(self) -> None:
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


def objective_function(src: Any, g: np.ndarray, corrections: Any, prior: Any, beta: float, *,
                       forward: Any = None) -> Any:
    """``f_host -> (Phi, L, R)`` of the stored-row model (float64): ``ybar = w (A f + b')`` with the rows'
    weights ``w`` (``m``, summed over a folded row) and ``b' = b / m``; rows with ``w = 0`` (gaps) are left
    out (their term does not depend on ``f``).

    ``forward``: the backend's own forward projection ``f -> A f`` where it holds the matrix in host memory
    (the CPU backends: no second copy, any size; exact in the float64 reference). Otherwise ``A f`` comes
    from a float64 SciPy copy of the stored matrix, made here, and None is returned for a matrix above
    :data:`OBJECTIVE_NNZ_MAX` non-zeros."""
    m, _ = (int(v) for v in src.shape)
    if forward is None:
        if int(src.nnz) > OBJECTIVE_NNZ_MAX:
            return None
        from mlemlib.matrix import CSRMatrix

        a = src.read_rows(0, m) if hasattr(src, "read_rows") else src
        a = (a if isinstance(a, CSRMatrix) else CSRMatrix.from_scipy(a)).to_scipy().astype(np.float64)

        def forward(f: np.ndarray) -> np.ndarray:
            return a @ np.asarray(f, dtype=np.float64)

    w = np.ones(m) if corrections is None or corrections.weights is None else np.asarray(corrections.weights, float)
    bg = None if corrections is None or corrections.background is None else np.asarray(corrections.background, float)
    keep = w > 0
    g64 = np.asarray(g, dtype=np.float64)

    def evaluate(f: np.ndarray) -> tuple[float, float, float]:
        fp = np.asarray(forward(f), dtype=np.float64)
        ybar = w * (fp + (0.0 if bg is None else np.where(keep, bg, 0.0)))
        y, gk = ybar[keep], g64[keep]
        pos = y > 0
        ll = float(np.sum(gk[pos] * np.log(y[pos])) - np.sum(y))
        if np.any(gk[~pos] > 0):
            ll = -math.inf
        r = float(prior.value(np.asarray(f, dtype=np.float64))) if beta else 0.0
        return ll - beta * r, ll, r

    return evaluate


def wrap(be: Any, model: Any, settings: MapSettings) -> MapBackend:
    """``be`` wrapped for MAP: the prior on the model's voxel grid (in its stored voxel order) and the objective
    of its stored-row model (:class:`mlemlib.problem.Problem`)."""
    from mlemlib.prior import make_prior, require_grid
    from mlemlib.provenance import source_name

    grid = require_grid(model.src, source_name(model.src, None))
    voxels = None if model.perm is None else model.perm.voxels
    prior = make_prior(settings.prior, grid, beta=settings.beta, gamma=settings.gamma, epsilon=settings.epsilon,
                       kappa=settings.kappa, voxels=voxels)
    objective = objective_function(model.src, model.g, model.corrections, prior, float(settings.beta),
                                   forward=be.forward if getattr(be, "matrix_on_host", False) else None)
    return MapBackend(be, settings, prior, model.norm, objective=objective)
