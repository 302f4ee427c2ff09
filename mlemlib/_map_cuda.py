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
of ``S``. What each launch does is a table on the device that it reads (:meth:`DeviceMapStep.steps`), and the
summed norms of each ``G`` the run will set are made when a GPU is prepared: one captured pass serves every
``G``.)

which is :class:`mlemlib.map.MapBackend`'s step written from ``bp_k`` instead of EM's image
(``f_EM = f bp_k / sk``). ``bp_k`` comes as float32 or as the deterministic kernels' 64-bit fixed point,
rounded to float32 as EM's update rounds it. The neighbours are read on the user's grid instead of through
the permutation (26 scattered reads per voxel), and the pair terms are formed in float: the double
divisions of the objective's stencils made the step cost 100 us per sub-iteration on madpet2 (H200). The
RDP's pair term takes one reciprocal, ``(d / den) (1 + (2 b + eps) / den)``, and its curvature
``2 / den (1 - term - gamma |term|)`` reuses it.
The image on the user's grid is made from ``f`` (through the voxel permutation, where the matrix has one)
before a pass's first sub-iteration only; each update writes the next sub-iteration's copy beside ``f``
(two buffers in turn), and the subsets' norms and ``1 / s`` are kept on the user's grid, so that of the
arrays the step reads and writes only ``bp_k`` and ``f`` go through the permutation.

Nothing allocates and nothing waits for the host, so a CUDA graph captures the step with the rest of the
pass; the relaxation ``lambda`` of the pass and ``G`` are device values set before a pass
(:meth:`DeviceMapStep.set_relaxation`, :meth:`DeviceMapStep.set_group`). One build of the kernel per prior
(its kind, the ``hessian`` preconditioner's curvature and ``kappa`` compile-time constants): the neighbour
loop holds only the arithmetic the run's prior needs. The same inputs give the same bits on every GPU (the gradient has
no atomics), so deterministic kernels stay bit-identical over GPU counts and reruns.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
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
    groups
        The subsets per sub-iteration the run will set (:meth:`set_group`; each divides S): their merged norms
        are made when a GPU is prepared, so that a change between passes is one value on the device.
    """

    def __init__(self, algorithm: str, prior: Any, beta: float, norms: np.ndarray, floor: float, *,
                 hessian: bool = False, offset: float = 0.0, average: bool = False,
                 groups: Iterable[int] = (1,)) -> None:
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
        self.groups = tuple(sorted({1, *(int(g) for g in groups)}))
        for g in self.groups:
            if g < 1 or self.subsets % g:
                raise ConfigError("subset_halving", f"{g} subsets per sub-iteration: S = {self.subsets} must be "
                                                    "divisible by it")
        #: The first row of each group size's merged norms in the norms each GPU holds (the sizes in turn).
        self._base = dict(zip(self.groups, np.cumsum([0] + [self.subsets // g for g in self.groups[:-1]])))
        #: Subsets per sub-iteration (:meth:`set_group`).
        self.group = 1
        self._dev: dict[int, dict[str, Any]] = {}

    def build(self) -> Any:
        """The build of ``map_step.cu`` for this run's prior and preconditioner (compile-time constants)."""
        from mlemlib.backends._build import Build

        options = []
        if int(self.prior.code):
            options.append(f"-DMAP_KIND={int(self.prior.code)}")
        if self.hessian:
            options.append("-DMAP_HESSIAN=1")
        if self.prior.kappa is not None:
            options.append("-DMAP_KAPPA=1")
        return Build("map_step", tuple(options))

    def merged_norms(self) -> np.ndarray:
        """The norms the launches read, in the backend's voxel order: for each group size of ``groups`` in turn
        (from row ``_base[g]``), its sub-iterations' summed norms (NaN where no subset of the sub-iteration sees
        the voxel), (sum of S / g, n) float32."""
        rows = []
        for g in self.groups:
            m = self._norms.reshape(self.subsets // g, g, -1)
            seen = np.any(~np.isnan(m), axis=1)
            rows.append(np.where(seen, np.nansum(m, axis=1), np.nan) if g > 1 else self._norms)
        return np.concatenate(rows).astype(np.float32)

    def _on_grid(self, a: np.ndarray) -> np.ndarray:
        """Per-voxel values (last axis) in the backend's voxel order, on the user's grid."""
        return np.ascontiguousarray(a if self.prior.pos is None else a[..., self.prior.inv])

    @functools.cached_property
    def _user_norms(self) -> np.ndarray:
        """:meth:`merged_norms` on the user's grid, made once for every GPU the step is prepared on."""
        return self._on_grid(self.merged_norms())

    def steps(self, group: int) -> np.ndarray:
        """What each launch ``k`` of a pass does with ``group`` subsets per sub-iteration, (S, 4) int32 rows
        ``(what, q, row, nsub)``: ``what`` 0 adds its back projection into the sum buffer as the first of its
        sub-iteration, 1 adds it, 2 updates the image, 3 updates with the sum added; ``q`` its sub-iteration,
        ``row`` the row of the sub-iteration's norm in :meth:`merged_norms`, ``nsub`` the pass's
        sub-iterations."""
        out = np.zeros((self.subsets, 4), dtype=np.int32)
        for k in range(self.subsets):
            slot, q = k % group, k // group
            what = (0 if slot == 0 else 1) if slot < group - 1 else (3 if group > 1 else 2)
            out[k] = (what, q, self._base[group] + q, self.subsets // group)
        return out

    def prepare(self, device: int, stream: Any) -> None:
        """Set up a GPU (its constants, buffers and kernels, compiled now: nothing is compiled or allocated
        inside a graph's capture); ``stream`` is where the backend runs its passes on it."""
        from mlemlib import _prior_cuda
        from mlemlib.backends._build import cupy, module

        cp = cupy()
        if device in self._dev:
            self._dev[device]["stream"] = stream
            return
        prior = self.prior
        n = int(prior.n)
        if n >= 2**31:
            raise ConfigError("image", f"{n} voxels: the MAP step on a GPU takes fewer than 2^31")
        with cp.cuda.Device(device):
            mod = module(self.build(), device)
            args = _prior_cuda.device_args(prior, cp.zeros(1, dtype=cp.float32))
            kappa, (nx, ny, nz), gamma, eps = args[1], args[7:10], args[11], args[12]
            # kappa on the user's grid (the prior's own device copy where the voxels keep their order)
            kappa_u = kappa if prior.kappa is None or prior.pos is None else cp.asarray(self._on_grid(prior.kappa))
            index = (lambda a: cp.asarray(np.asarray(a, dtype=np.int32))) if prior.pos is not None else (
                lambda a: cp.zeros(1, dtype=cp.int32))
            self._dev[device] = {
                "stream": stream, "inv_s": cp.asarray(self._on_grid(self._inv_s)), "lam": cp.ones(1, dtype=cp.float32),
                "steps": cp.asarray(self.steps(self.group)),
                "norms": cp.asarray(self._user_norms), "subset_of": {},
                "fu": (cp.empty(n, dtype=cp.float32), cp.empty(n, dtype=cp.float32)),
                "pos": index(prior.pos), "inv": index(prior.inv), "n": np.int32(n),
                "blocks": max(1, -(-n // THREADS)),
                "to_grid": mod.get_function("map_to_grid_f32"), "update": mod.get_function("map_update_f32"),
                "update_peer": mod.get_function("map_update_peer_f32"),
                "bpsum": cp.empty(n if self.groups[-1] > 1 else 1, dtype=cp.float32),
                "grid": (np.int32(nx), np.int32(ny), np.int32(nz), np.float32(gamma), np.float32(eps)),
                "kappa_u": kappa_u, "no_bp": cp.zeros(1, dtype=cp.float32), "no_acc": cp.zeros(1, dtype=cp.uint64),
                "mean": cp.zeros(n if self.average else 1, dtype=cp.float32),
            }  # fmt: skip
            cp.cuda.Device().synchronize()

    def set_group(self, group: int) -> None:
        """Cover ``group`` neighbouring subsets per sub-iteration from the next pass on (1: one each; one of the
        ``groups`` the step was made with): a value on each GPU, queued on its stream, which the launches read
        (a captured pass needs no new capture)."""
        from mlemlib.backends._build import cupy

        group = int(group)
        if group not in self._base:
            raise ConfigError("subset_halving", f"{group} subsets per sub-iteration: the step was prepared for "
                                                f"{', '.join(str(g) for g in self.groups)}")
        self.group = group
        value = self.steps(group)
        for device, d in self._dev.items():
            cp = cupy()
            with cp.cuda.Device(device):
                d["steps"].set(value, stream=d["stream"])

    def set_relaxation(self, lam: float) -> None:
        """The relaxation of the next pass, queued on every GPU's stream before it."""
        from mlemlib.backends._build import cupy

        cp = cupy()
        value = np.array([lam], dtype=np.float32)
        for device, d in self._dev.items():
            with cp.cuda.Device(device):
                d["lam"].set(value, stream=d["stream"])

    def _subset(self, d: dict[str, Any], norm: Any) -> int:
        """The subset of a launch with ``norm`` (the backend's array of the subset's norm): a pass launches subsets
        0, ..., S - 1 in order, each with its own norm."""
        k = d["subset_of"].setdefault(norm.data.ptr, len(d["subset_of"]))
        if k >= self.subsets:
            raise ConfigError("subsets", f"the MAP step was launched with more than {self.subsets} subsets' norms")
        return k

    def _to_grid(self, d: dict[str, Any], f: Any) -> None:
        """At a pass's first launch: ``f`` on the user's grid (``fu0``), on the current device and stream; later
        sub-iterations read the copy the one before wrote."""
        from mlemlib.backends._build import cupy

        cp = cupy()
        fu0 = d["fu"][0]
        if self.prior.pos is not None:
            d["to_grid"]((d["blocks"],), (THREADS,), (f, d["pos"], d["n"], fu0))
        else:
            rt = cp.cuda.runtime
            rt.memcpyAsync(fu0.data.ptr, f.data.ptr, f.nbytes, rt.memcpyDeviceToDevice, cp.cuda.get_current_stream().ptr)

    def register_peer(self, peer: Any, fs: list[Any], accs: list[Any]) -> None:
        """Make the address tables :meth:`launch_peer` reads, for the peer exchange ``peer`` of the GPUs of ``fs``
        (their images and fixed-point back projections, in ``peer.devices`` order): before a graph's capture."""
        devs = [self._dev[f.device.id] for f in fs]
        peer.register(fs, accs, [d["fu"][0] for d in devs], [d["fu"][1] for d in devs], [d["mean"] for d in devs])

    def launch_peer(self, peer: Any, fs: list[Any], norms: list[Any], accs: list[Any], scale: float,
                    streams: list[Any]) -> None:
        """The step of every GPU of the peer exchange ``peer`` fused with the exchange (each GPU's own image ``fs``,
        subset norm ``norms``, fixed-point back projection ``accs`` at ``scale`` and stream, in ``peer.devices``
        order): GPU k sums the back projection of its slice of the voxels (in ``f``'s order) over the GPUs and
        writes the slice's update into every GPU's arrays (``mlemlib/kernels/map_step.cu``,
        ``map_update_peer_f32``); the same bits as the all-reduce followed by :meth:`launch` on every GPU."""
        from mlemlib.backends._build import cupy

        cp = cupy()
        devs = [self._dev[f.device.id] for f in fs]
        ks = {self._subset(d, norm) for d, norm in zip(devs, norms)}
        if len(ks) != 1:
            raise ConfigError("subsets", "the GPUs of the MAP step were launched with different subsets")
        k = ks.pop()
        if k == 0:
            for d, f, stream in zip(devs, fs, streams):
                with cp.cuda.Device(f.device.id), stream:
                    self._to_grid(d, f)
        tables = {name: peer.table(bufs) for name, bufs in (
            ("f", fs), ("acc", accs), ("fu0", [d["fu"][0] for d in devs]), ("fu1", [d["fu"][1] for d in devs]),
            ("mean", [d["mean"] for d in devs]))}
        P, inv, n = np.int32(len(fs)), np.float64(1.0 / scale), int(devs[0]["n"])

        def launch(i: int, blocks: int, v0: int, v1: int) -> None:
            d = devs[i]
            nx, ny, nz, gamma, eps = d["grid"]
            d["update_peer"]((blocks,), (THREADS,), (
                tables["fu0"][i], tables["fu1"][i], d["kappa_u"], d["pos"], np.int32(self.prior.pos is not None), nx,
                ny, nz, gamma, eps, np.int32(ALGORITHM_CODES[self.algorithm]), tables["f"][i], tables["acc"][i], P,
                np.int32(i), np.int32(v0), np.int32(v1), inv, d["norms"], d["inv_s"], d["lam"], d["steps"],
                np.int32(k), d["n"], np.float32(self.beta), np.float32(self.floor), np.float32(self.offset),
                tables["mean"][i], np.int32(self.average), d["bpsum"]))

        peer.exchange(streams, n, launch)

    def launch(self, f: Any, norm: Any, *, bp: Any = None, acc: Any = None, scale: float | None = None) -> None:
        """The step on the current device and stream, in place on ``f``: ``bp`` (float32) or ``acc`` and its
        ``scale`` (fixed point) the all-reduced back projection; ``norm`` the backend's array of the subset's
        norm, which names the subset (the step reads its own copy of the norm, on the user's grid)."""
        d = self._dev[f.device.id]
        k = self._subset(d, norm)
        fixed = acc is not None
        blocks = (d["blocks"],)
        fu0, fu1 = d["fu"]
        if k == 0:
            self._to_grid(d, f)
        nx, ny, nz, gamma, eps = d["grid"]
        d["update"](blocks, (THREADS,), (
            fu0, fu1, d["kappa_u"], d["inv"], np.int32(self.prior.pos is not None), d["n"], nx, ny, nz, gamma, eps,
            np.int32(ALGORITHM_CODES[self.algorithm]), f, d["no_bp"] if fixed else bp, acc if fixed else d["no_acc"],
            np.float64(1.0 / scale if fixed else 0.0), np.int32(fixed), d["norms"], d["inv_s"], d["lam"], d["steps"],
            np.int32(k), np.float32(self.beta), np.float32(self.floor),
            np.float32(self.offset), d["mean"], np.int32(self.average), d["bpsum"]))

    def mean_of(self, f: Any) -> Any:
        """The mean of the last pass's sub-iterates on the GPUs of ``f`` (a list, one array per GPU, or one
        array), in the same form; written by the pass's launches (``average``), read once it is done."""
        if not self.average:
            raise ConfigError("averaging", "this MAP step forms no pass mean")
        if isinstance(f, list):
            return [self._dev[a.device.id]["mean"] for a in f]
        return self._dev[f.device.id]["mean"]
