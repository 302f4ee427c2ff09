"""Convergence of MAP measured as PETRIC does: metrics against a converged MAP image, and the time to threshold (host).

Provides

- :class:`MapRegions` and :func:`regions_from_truth`: the phantom's object (the
  voxels entirely inside its body), its background (:func:`mlemlib.phantom.region_masks`'s:
  inside the body, more than one voxel from every insert) and its spheres
  (each spherical insert's voxels), from a ``truth.h5``;
- :func:`pass_metrics`: one image against the converged image ``ref`` of the
  same problem: ``rmse_object`` and ``rmse_background`` (the RMSE over the
  region divided by ``ref``'s mean there) and per sphere ``|mean(f) -
  mean(ref)| / mean(ref)`` over its voxels;
- :func:`time_to_threshold`: the cumulative iteration time (and passes) until
  both RMSEs are below :data:`RMSE_THRESHOLD` and every sphere below
  :data:`SPHERE_THRESHOLD`;
- :class:`MetricsRecorder`: :func:`mlemlib.mlem.reconstruct`'s ``progress``
  callback that measures every pass (one copy of the device image to the host,
  mapped to the user's voxel order), and :func:`reconstruct_with_metrics`,
  which runs a reconstruction with it and adds the record to the run's
  ``timings.json`` (``map.metrics``, :data:`METRICS_FORMAT`);
- :func:`converged_map`: the converged MAP image of a problem, computed once
  (BSREM for many passes, by default on the float64 CPU reference path) and
  cached in an image file that records the problem's fingerprint.

The metrics are NumPy reductions in float64 over the host image, on every
backend; the iteration times are the run's own (``samples.iteration`` of
``timings.json``), which the metrics' host copies do not enter.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mlemlib.errors import ConfigError, InputError

log = logging.getLogger(__name__)

#: The thresholds: both RMSEs (relative to the converged image's region mean) and every sphere's mean error.
RMSE_THRESHOLD = 0.01
SPHERE_THRESHOLD = 0.005
#: BSREM passes of the converged image unless told otherwise.
CONVERGED_PASSES = 1000
#: BSREM's relaxation (``lambda_0``, ``eta``) for the converged image (with the ``hessian`` preconditioner).
CONVERGED_RELAXATION = (1.0, 40.0)
#: ``map.metrics["format"]`` in ``timings.json``.
METRICS_FORMAT = "mlem-map-metrics"


@dataclasses.dataclass(frozen=True)
class MapRegions:
    """Boolean masks (flat, the user's voxel order) of the phantom's object, background and spheres."""

    object: np.ndarray
    background: np.ndarray
    spheres: dict[str, np.ndarray]

    @classmethod
    def of(cls, object: Any, background: Any, spheres: Mapping[str, Any] | None = None) -> MapRegions:
        """Masks of any shape, flattened to bool (the same size each)."""
        flat = {k: np.asarray(v, dtype=bool).reshape(-1) for k, v in (spheres or {}).items()}
        obj, bg = np.asarray(object, dtype=bool).reshape(-1), np.asarray(background, dtype=bool).reshape(-1)
        if bg.size != obj.size or any(v.size != obj.size for v in flat.values()):
            raise ValueError(f"region masks differ in size: object {obj.size}, background {bg.size}, spheres "
                             f"{sorted({v.size for v in flat.values()})}")
        return cls(obj, bg, flat)


def regions_from_truth(truth: str | os.PathLike) -> MapRegions:
    """The :class:`MapRegions` of a simulated phantom's ``truth.h5`` (its ``regions``, ``grid``, ``voxel_size``).

    Raises
    ------
    ConfigError
        The truth records no phantom regions or no grid.
    """
    from mlemlib.image import read_image
    from mlemlib.phantom import Phantom, Sphere, region_masks

    _, attrs = read_image(truth)
    text, grid, vs = attrs.get("regions"), attrs.get("grid"), attrs.get("voxel_size")
    if not text or grid is None or vs is None:
        raise ConfigError(os.fspath(truth), "has no phantom regions (or no grid): no MAP convergence metrics")
    ph = Phantom.from_json(text.decode() if isinstance(text, bytes) else text)
    masks = region_masks(ph, grid, vs)
    # the body alone: region_masks' background of a phantom without inserts is every voxel inside the body
    body = region_masks(Phantom(ph.name, [ph.body]), grid, vs).background
    spheres = {sh.label: masks.masks[sh.label] for sh in ph.shapes[1:] if isinstance(sh, Sphere)}
    return MapRegions.of(body, masks.background, spheres)


def _flat64(a: Any) -> np.ndarray:
    return np.asarray(a, dtype=np.float64).reshape(-1)


def relative_rmse(f: Any, ref: Any, mask: Any) -> float:
    """``sqrt(mean((f - ref)^2))`` over ``mask`` divided by ``mean(ref)`` there (NaN for an empty mask;
    ``inf`` where ``ref``'s mean is 0 and the images differ, 0 where they do not)."""
    f, r, m = _flat64(f), _flat64(ref), np.asarray(mask, dtype=bool).reshape(-1)
    if not m.any():
        return math.nan
    rmse = float(np.sqrt(np.mean((f[m] - r[m]) ** 2)))
    return _ratio(rmse, float(np.mean(r[m])))


def mean_error(f: Any, ref: Any, mask: Any) -> float:
    """``|mean(f) - mean(ref)| / mean(ref)`` over ``mask`` (NaN for an empty mask)."""
    f, r, m = _flat64(f), _flat64(ref), np.asarray(mask, dtype=bool).reshape(-1)
    if not m.any():
        return math.nan
    mr = float(np.mean(r[m]))
    return _ratio(abs(float(np.mean(f[m])) - mr), mr)


def _ratio(num: float, den: float) -> float:
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / abs(den)


def pass_metrics(f: Any, ref: Any, regions: MapRegions) -> dict[str, Any]:
    """The metrics of one image ``f`` against the converged image ``ref`` (both in the user's voxel order).

    Returns
    -------
    dict
        ``rmse_object``, ``rmse_background`` (:func:`relative_rmse`) and
        ``spheres``: label -> :func:`mean_error`.

    Raises
    ------
    ValueError
        The images or masks differ in size.
    """
    f, r = _flat64(f), _flat64(ref)
    if f.size != r.size or f.size != regions.object.size:
        raise ValueError(f"sizes differ: image {f.size}, converged image {r.size}, regions {regions.object.size}")
    return {"rmse_object": relative_rmse(f, r, regions.object),
            "rmse_background": relative_rmse(f, r, regions.background),
            "spheres": {k: mean_error(f, r, m) for k, m in regions.spheres.items()}}


def below(metrics: Mapping[str, Any], rmse: float = RMSE_THRESHOLD, sphere: float = SPHERE_THRESHOLD) -> bool:
    """Whether one pass's metrics meet the thresholds: both RMSEs ``< rmse`` and every sphere ``< sphere``
    (NaN never does; a phantom without spheres has no sphere to fail)."""
    values = [(metrics.get("rmse_object"), rmse), (metrics.get("rmse_background"), rmse),
              *((v, sphere) for v in (metrics.get("spheres") or {}).values())]
    return all(v is not None and math.isfinite(float(v)) and float(v) < limit for v, limit in values)


def time_to_threshold(metrics: Sequence[Mapping[str, Any]], seconds: Sequence[float], *,
                      rmse: float = RMSE_THRESHOLD, sphere: float = SPHERE_THRESHOLD,
                      stay: bool = False) -> dict[str, float | int] | None:
    """The iteration time until a run first meets the thresholds, or None if it never does.

    Parameters
    ----------
    metrics
        Per recorded pass: ``pass`` (1 is the first pass; 0 the initial image)
        and :func:`pass_metrics`' values, in pass order.
    seconds
        The iteration time of every pass: ``seconds[p - 1]`` is pass ``p``'s.
    rmse, sphere
        The thresholds (:data:`RMSE_THRESHOLD`, :data:`SPHERE_THRESHOLD`).
    stay
        False (PETRIC's rule): the first recorded pass at which all hold. True:
        the first recorded pass from which they hold at every later recorded pass.

    Returns
    -------
    dict or None
        ``passes`` (that pass) and ``seconds`` (the sum of the iteration
        times of passes 1 to it; 0 for the initial image).

    Raises
    ------
    ValueError
        ``seconds`` does not cover the pass found.
    """
    ok = [below(m, rmse, sphere) for m in metrics]
    found = None
    for k, m in enumerate(metrics):
        if ok[k] and (not stay or all(ok[k:])):
            found = int(m["pass"])
            break
    if found is None:
        return None
    if found > len(seconds):
        raise ValueError(f"pass {found} met the thresholds but only {len(seconds)} iteration times are given")
    return {"passes": found, "seconds": float(math.fsum(float(s) for s in seconds[:found]))}


def series(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The per-pass metrics of a ``map.metrics`` record (its columns) as one dict per pass."""
    spheres = record.get("spheres") or {}
    return [{"pass": p, "rmse_object": record["rmse_object"][k], "rmse_background": record["rmse_background"][k],
             "spheres": {s: v[k] for s, v in spheres.items()}} for k, p in enumerate(record.get("passes") or [])]


def _host(image: Any) -> np.ndarray:
    """A device image on the host (CuPy's ``get``); a list of replicas (several GPUs) by its first."""
    if isinstance(image, (list, tuple)):
        image = image[0]
    return image.get() if hasattr(image, "get") and not isinstance(image, np.ndarray) else np.asarray(image)


class MetricsRecorder:
    """:func:`mlemlib.mlem.reconstruct`'s ``progress`` callback recording :func:`pass_metrics` per pass.

    Parameters
    ----------
    ref
        The converged MAP image (user's voxel order).
    regions
        The phantom's :class:`MapRegions`.
    perm
        The matrix's :class:`mlemlib.reorder.Permutation` (None: not reordered): the
        device image is mapped to the user's voxel order with it.
    every
        Record every k-th pass (and none between: each costs a copy to the host).
    repetition
        The repetition to record (the others are not measured).
    reference
        What ``ref`` is, for the record (e.g. the cache file's path and its passes).
    """

    def __init__(self, ref: Any, regions: MapRegions, *, perm: Any = None, every: int = 1, repetition: int = 0,
                 reference: Mapping[str, Any] | None = None) -> None:
        self.ref = _flat64(ref)
        if self.ref.size != regions.object.size:
            raise ValueError(f"the converged image has {self.ref.size} voxels, the regions {regions.object.size}")
        if isinstance(every, bool) or int(every) < 1:
            raise ConfigError("every", f"must be an integer >= 1, got {every!r}")
        self.regions, self.perm, self.every, self.repetition = regions, perm, int(every), int(repetition)
        self.reference = dict(reference or {})
        self.passes: list[int] = []
        self.values: list[dict[str, Any]] = []

    def __call__(self, repetition: int, iteration: int, image: Any) -> None:
        if repetition != self.repetition or iteration % self.every:
            return
        host = _host(image)
        if self.perm is not None:
            from mlemlib.reorder import image_to_user_order

            host = image_to_user_order(host, self.perm)
        self.passes.append(int(iteration))
        self.values.append(pass_metrics(host, self.ref, self.regions))

    def record(self) -> dict[str, Any]:
        """``timings.json``'s ``map.metrics``: the thresholds and the metrics as columns over ``passes``."""
        return {"format": METRICS_FORMAT, "repetition": self.repetition, "every": self.every,
                "reference": self.reference, "thresholds": {"rmse": RMSE_THRESHOLD, "sphere": SPHERE_THRESHOLD},
                "passes": list(self.passes),
                "rmse_object": [m["rmse_object"] for m in self.values],
                "rmse_background": [m["rmse_background"] for m in self.values],
                "spheres": {s: [m["spheres"][s] for m in self.values] for s in self.regions.spheres}}


def add_metrics(timings_path: str | os.PathLike, record: Mapping[str, Any]) -> dict[str, Any]:
    """Write ``record`` (:meth:`MetricsRecorder.record`) into a MAP run's ``timings.json`` as ``map.metrics``.

    Raises
    ------
    InputError
        The file is not a MAP run's ``timings.json``.
    """
    import json

    from mlemlib._io import atomic_path
    from mlemlib.provenance import dumps

    path = Path(timings_path)
    try:
        t = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InputError(path, f"not a readable timings.json ({exc})") from None
    if not isinstance(t, dict) or not isinstance(t.get("map"), dict):
        raise InputError(path, "not a MAP run's timings.json (no 'map')")
    t["map"]["metrics"] = _finite(dict(record))
    with atomic_path(path) as tmp:
        tmp.write_text(dumps(t, indent=1, allow_nan=False) + "\n")
    return t


def _finite(v: Any) -> Any:
    """JSON without NaN/inf: those as None."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def reconstruct_with_metrics(model: Any, settings: Any, out_image: str | os.PathLike, *, converged: Any,
                             truth: str | os.PathLike, every: int = 1, repetition: int = 0,
                             **kwargs: Any) -> dict[str, Any]:
    """:func:`mlemlib.mlem.reconstruct` of a MAP run, measuring every ``every``-th pass against ``converged``.

    ``model`` (a :class:`mlemlib.problem.ModelSpec` with a prior, ``map``) and ``settings`` (a
    :class:`mlemlib.problem.RunSettings`) as ``reconstruct`` takes them. ``converged`` is the converged image
    (an ``image.h5`` of :func:`converged_map`, or an array in the user's voxel order), ``truth`` the
    phantom's ``truth.h5`` (its regions; also the run's truth, for its accuracy against the phantom);
    ``kwargs`` are ``reconstruct``'s other ones (``progress`` is taken). The record goes into the
    run's ``timings.json`` as ``map.metrics`` (:func:`add_metrics`) and into the returned timings.
    """
    from mlemlib.formats import open_source
    from mlemlib.image import read_image
    from mlemlib.mlem import reconstruct
    from mlemlib.reorder import permutation_of

    if model.map is None:
        raise ConfigError("map", "MAP convergence metrics need a MAP run (a model with a prior)")
    if isinstance(converged, (str, os.PathLike)):
        ref, attrs = read_image(converged)
        about = {"image": os.fspath(converged), "problem": attrs.get("problem"), "passes": attrs.get("iterations")}
    else:
        ref, about = _flat64(converged), {"image": None}
    src = open_source(model.matrix, "matrix")
    try:
        perm = permutation_of(src)
    finally:
        if src is not model.matrix and hasattr(src, "close"):
            src.close()
    rec = MetricsRecorder(ref, regions_from_truth(truth), perm=perm, every=every, repetition=repetition,
                          reference=about)
    timings = reconstruct(model, settings, out_image, progress=rec, truth=truth, **kwargs)
    record = rec.record()
    path = (timings.get("outputs") or {}).get("timings")
    if path:
        timings = add_metrics(path, record)
    else:
        timings.setdefault("map", {})["metrics"] = _finite(record)
    return timings


def problem_fingerprint_of(model: Any) -> str:
    """The fingerprint :func:`mlemlib.mlem.reconstruct` gives the problem of ``model`` (a
    :class:`mlemlib.problem.ModelSpec`; its image's ``problem`` attribute), computed as
    :func:`mlemlib.problem.load_problem` does, without the norm or the backend."""
    from mlemlib.formats import open_source
    from mlemlib.problem import load_corrections, problem_identity, stored_measurement
    from mlemlib.provenance import problem_fingerprint, source_name

    matrix = model.matrix
    src = open_source(matrix, "matrix")
    try:
        g, row_fold, perm = stored_measurement(src, matrix, model.sino)
        corr = load_corrections(src, source_name(src, matrix), row_fold, perm, model, np.dtype(np.float64))
        return problem_fingerprint(src, g, problem_identity(corr, model.map))
    finally:
        if src is not matrix and hasattr(src, "close"):
            src.close()


def converged_settings(map_settings: Any) -> Any:
    """The settings of the converged image: ``map_settings``' prior with BSREM (the algorithm that converges),
    the ``hessian`` preconditioner without an offset and the relaxation :data:`CONVERGED_RELAXATION`, each
    pass's last sub-iterate, every subset in every pass (a run's ``averaging`` and ``subset_halving`` do not
    change its converged image).

    Every BSREM setting converges to the same maximiser of ``Phi``; these get there in the fewest passes
    that were measured (on madpet2 with 16 subsets, 1500 passes were within 0.06% of 3000 in every metric,
    where the default relaxation's 3000 passes were still 0.31% off in the slowest sphere)."""
    return dataclasses.replace(map_settings, algorithm="bsrem", preconditioner="hessian", preconditioner_offset=0.0,
                               relaxation=CONVERGED_RELAXATION, averaging="last",
                               subset_halving=()).check()


def converged_map(model: Any, cache: str | os.PathLike, *, passes: int = CONVERGED_PASSES,
                  settings: Any | None = None) -> tuple[np.ndarray, dict[str, Any]]:
    """The converged MAP image of a problem, computed once and cached in ``cache`` (an ``image.h5``).

    The image is that of ``model`` (a :class:`mlemlib.problem.ModelSpec` with a prior, ``map``) with BSREM
    (:func:`converged_settings`: its prior with ``algorithm="bsrem"``, the ``hessian`` preconditioner and
    :data:`CONVERGED_RELAXATION`) after
    ``passes`` passes, run as ``settings`` say (a :class:`mlemlib.problem.RunSettings`, its iterations
    replaced by ``passes``; default: the float64 CPU reference path, no checkpoints). The cache is reused
    where it records this problem (its ``problem`` attribute, the fingerprint :func:`problem_fingerprint_of`
    computes: matrix, measurement, subsets, ``m``, ``b``, prior and BSREM's settings), the same ``passes``
    and the same ``reference_mode``; otherwise it is recomputed and overwritten.

    Returns
    -------
    (numpy.ndarray, dict)
        The image (user's voxel order) and the cache file's attributes
        (``problem``, ``iterations``, ``converged_map``: the settings, ``phi``: Phi after the last pass).

    Raises
    ------
    ConfigError
        Bad settings or passes, or a model without a prior.
    """
    from mlemlib.image import read_image, write_image
    from mlemlib.mlem import reconstruct
    from mlemlib.problem import RunSettings, check_int

    passes = check_int("passes", passes, 1)
    if model.map is None:
        raise ConfigError("map", "the converged MAP image needs a model with a prior")
    model = dataclasses.replace(model, map=converged_settings(model.map))
    settings = (RunSettings(passes, checkpoint_every=0, reference_mode=True) if settings is None
                else dataclasses.replace(settings, iterations=passes))
    cache = Path(cache)
    want = problem_fingerprint_of(model)
    if cache.exists():
        try:
            img, attrs = read_image(cache)
        except InputError as exc:
            log.warning("%s: unreadable (%s); recomputing the converged MAP image", cache, exc)
        else:
            found = (attrs.get("problem"), attrs.get("iterations"), bool(attrs.get("reference")),
                     attrs.get("converged_map") is not None)
            if found == (want, passes, settings.reference_mode, True):
                log.info("%s: the converged MAP image of problem %s after %d passes (cached)", cache, want[:12], passes)
                return img, attrs
            log.info("%s: another problem or pass count (%s after %s passes); recomputing", cache,
                     str(attrs.get("problem"))[:12], attrs.get("iterations"))
    cache.parent.mkdir(parents=True, exist_ok=True)
    work = cache.with_name(f".{cache.stem}.run.h5")
    try:
        timings = reconstruct(model, settings, work, raw_out=False, timings_out=False)
        img, attrs = read_image(work)
    finally:
        work.unlink(missing_ok=True)
    if attrs.get("problem") != want:  # the fingerprint is computed as load_problem does: a mismatch is a bug
        raise RuntimeError(f"converged MAP image of problem {attrs.get('problem')}, expected {want}")
    history = (timings.get("map") or {}).get("history") or []
    extra = {"converged_map": model.map.record(), "phi": history[-1]["phi"] if history else None}
    keep = {k: v for k, v in attrs.items() if k not in ("format", "version", "column_order", "grid", "voxel_size")}
    write_image(cache, img, grid=attrs.get("grid"), voxel_size=attrs.get("voxel_size"), attrs={**keep, **extra})
    log.info("wrote %s: the converged MAP image of problem %s after %d passes", cache, want[:12], passes)
    return read_image(cache)


__all__ = [
    "CONVERGED_PASSES",
    "CONVERGED_RELAXATION",
    "METRICS_FORMAT",
    "RMSE_THRESHOLD",
    "SPHERE_THRESHOLD",
    "MapRegions",
    "MetricsRecorder",
    "add_metrics",
    "below",
    "converged_map",
    "converged_settings",
    "mean_error",
    "pass_metrics",
    "problem_fingerprint_of",
    "reconstruct_with_metrics",
    "regions_from_truth",
    "relative_rmse",
    "series",
    "time_to_threshold",
]
