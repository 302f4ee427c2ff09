"""The MAP step on a GPU backend's own streams: the prior's gradient and the BSREM or OSL update, as the
update of each sub-iteration (CuPy imported lazily, on first use).

A GPU backend that takes an image step (:meth:`mlemlib.backends.nccl.NcclBackend.set_image_step`, and
:class:`~mlemlib.backends.osem.OsemBackend` for its subsets) launches :meth:`DeviceMapStep.launch` where
EM's update would run: after the (all-reduced) back projection ``bp_k`` of subset ``k``, on each GPU's
stream, with the image ``f`` still the one the sub-iteration started from. One thread per voxel
(``mlemlib/kernels/map_step.cu``) forms the prior's gradient from its neighbours on the user's grid and
writes the update (``sk`` the subset's sensitivity, 0 where the backend's norm is NaN; ``s`` the sum of
the subsets' sensitivities; ``S`` the subset count)::

    BSREM  f <- max(nu, f + lambda (f / s) (S (bp_k - sk) - beta grad))   (0 where s = 0)
    OSL    f <- f bp_k / (sk + beta grad / S)   where sk > 0 and the denominator > 0, else EM's update

(BSREM with the ``hessian`` preconditioner: the step divided by ``1 + beta f H / s``, ``H`` the diagonal of
the prior's Hessian at ``f``, formed in the same pass over the neighbours; with an offset ``delta``,
``f + delta`` in place of ``f`` in the preconditioner; with ``average``, the same threads sum the pass's
sub-iterates into a buffer of their own and divide the sum by ``S`` after the last, the pass's mean image; with
:meth:`DeviceMapStep.set_group` ``G > 1`` (BSREM's subset halving), each sub-iteration covers ``G``
neighbouring subsets: the launches of its first ``G - 1`` subsets add their ``bp_k`` into a buffer and leave
``f`` as it is, the last one's updates with the summed ``bp``, the subsets' summed ``sk`` and ``S / G`` in place
of ``S``.)

which is :class:`mlemlib.map.MapBackend`'s step written from ``bp_k`` instead of EM's image
(``f_EM = f bp_k / sk``). ``bp_k`` comes as float32 or as the deterministic kernels' 64-bit fixed point,
rounded to float32 as EM's update rounds it. The neighbours are read on the user's grid instead of through
the permutation (26 scattered reads per voxel), and the pair terms are formed in float: the double
divisions of the objective's stencils made the step cost 100 us per sub-iteration on madpet2 (H200).
The image on the user's grid is made from ``f`` (through the voxel permutation, where the matrix has one)
before a pass's first sub-iteration only; each update writes the next sub-iteration's copy beside ``f``
(two buffers in turn), and the subsets' norms and ``1 / s`` are kept on the user's grid, so that of the
arrays the step reads and writes only ``bp_k`` and ``f`` go through the permutation.

Nothing allocates and nothing waits for the host, so a CUDA graph captures the step with the rest of the
pass; the relaxation ``lambda`` of the pass is a device value set before each pass
(:meth:`DeviceMapStep.set_relaxation`). The same inputs give the same bits on every GPU (the gradient has
no atomics), so deterministic kernels stay bit-identical over GPU counts and reruns.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mlemlib.errors import ConfigError
from mlemlib.subsets import sensitivities_of

#: The kernels' algorithm codes.
ALGORITHM_CODES = {"bsrem": 0, "osl": 1}
THREADS = 256


class DeviceMapStep:
    """The MAP step of one run, for the GPUs of a backend (module docstring).

    Parameters
    ----------
    algorithm
        ``bsrem`` or ``osl``.
    prior
        The :class:`mlemlib.prior.Prior` in the backend's voxel order.
    beta
        The prior's weight (0: no gradient is computed).
    norms
        The (S, n) update norms of the subsets, or the (n,) norm of S = 1 (NaN: the subset does not see the
        voxel), in the backend's voxel order: the norms the backend launches the step with, sub-iteration
        ``k`` with row ``k``.
    floor
        BSREM's positivity bound ``nu``.
    hessian
        BSREM's preconditioner ``f / (s + beta f H)`` (``H`` the diagonal of the prior's Hessian at
        ``f``, formed in the same pass over the neighbours) instead of ``f / s``.
    offset
        BSREM's preconditioner offset ``delta`` in image units: ``f + delta`` in place of ``f`` in the
        preconditioner (0: none).
    average
        Also form the mean of each pass's sub-iterates, in a buffer of its own per GPU (:meth:`mean_of`).
    """

    def __init__(self, algorithm: str, prior: Any, beta: float, norms: np.ndarray, floor: float, *,
                 hessian: bool = False, offset: float = 0.0, average: bool = False) -> None:
        norms = np.asarray(norms, dtype=np.float32)
        self._norms = norms.reshape(1, -1) if norms.ndim == 1 else norms  # NaN kept: OSL keeps f there
        self._inv_s = sensitivities_of(self._norms)[2].astype(np.float32)
        self.subsets = self._norms.shape[0]
        self.algorithm = algorithm
        self.prior = prior
        self.beta = float(beta)
        self.floor = float(floor)
        self.hessian = bool(hessian)
        self.offset = float(offset)
        self.average = bool(average)
        #: Subsets per sub-iteration (:meth:`set_group`).
        self.group = 1
        self._dev: dict[int, dict[str, Any]] = {}

    def prepare(self, device: int, stream: Any) -> None:
        """Set up a GPU (its constants, buffers and kernels, compiled now: nothing is compiled or allocated
        inside a graph's capture); ``stream`` is where the backend runs its passes on it."""
        from mlemlib import _prior_cuda
        from mlemlib.backends._build import Build, cupy, module

        cp = cupy()
        if device in self._dev:
            self._dev[device]["stream"] = stream
            return
        prior = self.prior
        with cp.cuda.Device(device):
            mod = module(Build("map_step"), device)
            _, kappa, pos, inv, has_kappa, perm, _, nx, ny, nz, code, gamma, eps, *_ = _prior_cuda.device_args(
                prior, cp.zeros(1, dtype=cp.float32))
            n = int(prior.n)
            if n >= 2**31:
                raise ConfigError("image", f"{n} voxels: the MAP step on a GPU takes fewer than 2^31")
            kappa_u = kappa
            if prior.kappa is not None and prior.inv is not None:  # kappa on the user's grid
                kappa_u = cp.asarray(np.ascontiguousarray(prior.kappa[prior.inv]))
            user = (lambda a: a) if prior.pos is None else (lambda a: a[..., prior.inv])  # to the user's grid
            self._dev[device] = {
                "stream": stream, "inv_s": cp.asarray(user(self._inv_s)), "lam": cp.ones(1, dtype=cp.float32),
                "norms": {1: cp.asarray(np.ascontiguousarray(user(self._norms)))}, "subset_of": {}, "user": user,
                "fu": (cp.empty(n, dtype=cp.float32), cp.empty(n, dtype=cp.float32)), "pos": pos, "n": np.int64(n),
                "blocks": max(1, -(-n // THREADS)),
                "to_grid": mod.get_function("map_to_grid_f32"), "update": mod.get_function("map_update_f32"),
                "accumulate": mod.get_function("map_accumulate_f32"), "bpsum": None,
                "prior": (kappa_u, inv, has_kappa, perm, np.int32(n), np.int32(nx), np.int32(ny), np.int32(nz), code,
                          np.float32(gamma), np.float32(eps)),
                "no_bp": cp.zeros(1, dtype=cp.float32), "no_acc": cp.zeros(1, dtype=cp.uint64),
                "mean": cp.zeros(n if self.average else 1, dtype=cp.float32),
            }  # fmt: skip
            self._prepare_group(device)
            cp.cuda.Device().synchronize()

    def set_group(self, group: int) -> None:
        """Cover ``group`` neighbouring subsets per sub-iteration from the next pass on (1: one each; S must be
        divisible by it). The launches' arguments change: a backend that captured its pass captures it again
        (:meth:`mlemlib.backends.osem.OsemBackend.set_image_step`)."""
        group = int(group)
        if group < 1 or self.subsets % group:
            raise ConfigError("subset_halving", f"{group} subsets per sub-iteration: S = {self.subsets} must be "
                                                "divisible by it")
        self.group = group
        for device in self._dev:
            self._prepare_group(device)

    def _prepare_group(self, device: int) -> None:
        """The merged subsets' norms (on the user's grid) and the back projections' sum buffer of the current
        group size on ``device`` (made once per size; nothing allocates inside a capture)."""
        from mlemlib.backends._build import cupy

        cp = cupy()
        d, g = self._dev[device], self.group
        if g in d["norms"]:
            return
        with cp.cuda.Device(device):
            merged = np.nansum(self._norms.reshape(self.subsets // g, g, -1), axis=1).astype(np.float32)
            d["norms"][g] = cp.asarray(np.ascontiguousarray(d["user"](merged)))
            if d["bpsum"] is None:
                d["bpsum"] = cp.empty(int(d["n"]), dtype=cp.float32)
            cp.cuda.Device().synchronize()

    def set_relaxation(self, lam: float) -> None:
        """The relaxation of the next pass, queued on every GPU's stream before it."""
        from mlemlib.backends._build import cupy

        cp = cupy()
        value = np.array([lam], dtype=np.float32)
        for device, d in self._dev.items():
            with cp.cuda.Device(device):
                d["lam"].set(value, stream=d["stream"])

    def launch(self, f: Any, norm: Any, *, bp: Any = None, acc: Any = None, scale: float | None = None) -> None:
        """The step on the current device and stream, in place on ``f``: ``bp`` (float32) or ``acc`` and its
        ``scale`` (fixed point) the all-reduced back projection; ``norm`` the backend's array of the subset's
        norm, which names the subset (the step reads its own copy of the norm, on the user's grid)."""
        from mlemlib.backends._build import cupy

        cp = cupy()
        d = self._dev[f.device.id]
        # the subset of this launch: a pass launches subsets 0, ..., S - 1 in order, each with its own norm
        k = d["subset_of"].setdefault(norm.data.ptr, len(d["subset_of"]))
        if k >= self.subsets:
            raise ConfigError("subsets", f"the MAP step was launched with more than {self.subsets} subsets' norms")
        fixed = acc is not None
        g, blocks = self.group, (d["blocks"],)
        if k % g < g - 1:  # not the last subset of its sub-iteration: its bp added to the others', f unchanged
            d["accumulate"](blocks, (THREADS,), (d["bpsum"], d["no_bp"] if fixed else bp,
                                                 acc if fixed else d["no_acc"],
                                                 np.float64(1.0 / scale if fixed else 0.0), np.int32(fixed),
                                                 np.int32(k % g == 0), d["n"]))
            return
        q, nsub = k // g, self.subsets // g  # the sub-iteration of the pass, and the pass's count
        fu = d["fu"][q % 2]
        if q == 0:  # f on the user's grid; later sub-iterations read the copy the one before wrote
            if self.prior.pos is not None:
                d["to_grid"](blocks, (THREADS,), (f, d["pos"], d["n"], fu))
            else:
                rt = cp.cuda.runtime
                rt.memcpyAsync(fu.data.ptr, f.data.ptr, f.nbytes, rt.memcpyDeviceToDevice,
                               cp.cuda.get_current_stream().ptr)
        d["update"](blocks, (THREADS,), (
            fu, *d["prior"], np.int32(ALGORITHM_CODES[self.algorithm]), f, d["no_bp"] if fixed else bp,
            acc if fixed else d["no_acc"], np.float64(1.0 / scale if fixed else 0.0), np.int32(fixed),
            d["norms"][g][q], d["inv_s"], d["lam"], np.float32(self.beta), np.float32(nsub), np.float32(self.floor),
            np.int32(self.hessian), np.float32(self.offset), d["fu"][(q + 1) % 2], np.int32(q + 1 < nsub),
            d["mean"], np.int32(self.average), np.int32(q == 0), d["no_bp"] if g == 1 else d["bpsum"],
            np.int32(g > 1)))

    def mean_of(self, f: Any) -> Any:
        """The mean of the last pass's sub-iterates on the GPUs of ``f`` (a list, one array per GPU, or one
        array), in the same form; written by the pass's launches (``average``), read once it is done."""
        if not self.average:
            raise ConfigError("averaging", "this MAP step forms no pass mean")
        if isinstance(f, list):
            return [self._dev[a.device.id]["mean"] for a in f]
        return self._dev[f.device.id]["mean"]
