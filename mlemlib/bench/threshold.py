"""A MAP case's time to threshold: PETRIC's measure of a MAP run, through the library's public API (host side; the
runs on the case's backend).

For a case with ``threshold`` (:class:`mlemlib.bench.cases.Threshold`) each MAP row also measures how long BSREM
with the row's prior takes to reach the MAP image of a realistic problem:

1. the measurement: the NEMA phantom simulated on the prepared matrix (:func:`mlemlib.phantom.simulate`) with
   every effect (attenuation, normalisation spread 0.1, randoms 0.2 and scatter 0.3 of the counts), written
   once into the prepared matrix's directory (``sim-<key>/``: ``g.LMsino``, ``m.f32``, ``b.f32``,
   ``truth.h5``);
2. the prior: the relative difference prior with ``gamma = 2``, ``beta`` by the rule ``c = 0.25``
   (``beta = 0.25 mean(s) mean(m) / 19.1``, ``s`` the prepared matrix's column sums) and ``epsilon`` 1e-3 of the
   initial image's value (``sum g / (sum s mean(m))``), as docs/reconstruction.md chooses them;
3. the converged image: :func:`mlemlib.map_metrics.converged_map` after ``converged_passes`` passes on the case's
   backend and one device, cached beside the measurement (made again only where the problem or the passes
   differ);
4. the run: :func:`mlemlib.map_metrics.reconstruct_with_metrics` with the row's BSREM settings (``rdp``: the
   defaults; ``rdp-fast``: :data:`mlemlib.bench.cases.FAST_MAP`) and the threshold's ``subset_halving``, for
   ``passes`` passes on the row's GPUs, each pass measured against the converged image;
   :func:`mlemlib.map_metrics.time_to_threshold` gives the first pass where both RMSEs are below 1% and every
   sphere's mean error below 0.5%, and the iteration time to it (every pass's own time summed).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from mlemlib.bench.cases import Case, Threshold, bench_settings, rdp_weights, settings_key
from mlemlib.bench.prepare import Prepared

log = logging.getLogger(__name__)

#: The simulated scanner effects (fractions of the expected counts; the spread of the crystal efficiencies).
EFFECTS = {"attenuation": True, "normalisation_spread": 0.1, "randoms_fraction": 0.2, "scatter_fraction": 0.3}


def simulated(matrix: str | os.PathLike, directory: Path, threshold: Threshold) -> dict[str, Path]:
    """The NEMA phantom's measurement with :data:`EFFECTS` on ``matrix``, written once into ``directory``
    (``sim-<key>/``, the key from the counts, the seed and the effects; ``simulated.json`` written last)."""
    from mlemlib.phantom import ScannerEffects, simulate

    spec = {"phantom": "nema", "counts": threshold.counts, "seed": threshold.seed, **EFFECTS}
    out = directory / f"sim-{settings_key(spec)}"
    files = {"g": out / "g.LMsino", "m": out / "m.f32", "b": out / "b.f32", "truth": out / "truth.h5"}
    if (out / "simulated.json").exists() and all(p.exists() for p in files.values()):
        return files
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    info = simulate(os.fspath(matrix), "nema", files["g"], files["truth"], seed=threshold.seed,
                    counts=threshold.counts, effects=ScannerEffects(**EFFECTS),
                    out_multiplicative=files["m"], out_additive=files["b"])
    (out / "simulated.json").write_text(json.dumps({**spec, "counts_drawn": info.get("counts")}, indent=1) + "\n")
    return files


def prior_settings(prior: str, norm: str | os.PathLike, files: dict[str, Path], halving: tuple[int, ...]) -> Any:
    """The row's :class:`mlemlib.map.MapSettings`: the RDP with the module docstring's ``beta`` and ``epsilon``
    (:func:`mlemlib.bench.cases.rdp_weights`; ``norm`` the prepared matrix's column sums, ``norm.npy``), BSREM
    with ``prior``'s settings and the subsets halving after ``halving``."""
    from mlemlib.map import MapSettings

    cs = np.load(norm).astype(np.float64)
    m = float(np.fromfile(files["m"], dtype="<f4").astype(np.float64).mean())
    g = np.fromfile(files["g"], dtype="<i4").astype(np.float64)
    beta, epsilon = rdp_weights(cs.mean() * m, cs.sum() * m, g.sum())
    return MapSettings("rdp", beta=beta, gamma=2.0, epsilon=epsilon, subset_halving=tuple(halving),
                       **bench_settings(prior)).check()


def measure(case: Case, prep: Prepared, prior: str, gpus: int) -> dict[str, Any]:
    """The threshold columns of one MAP row (module docstring) on the prepared matrix ``prep``:
    ``passes_to_threshold`` and
    ``seconds_to_threshold`` (None where the run did not get there), ``threshold_pass_ms`` (the run's median
    pass), ``threshold_passes``, ``converged_passes``, ``threshold_beta``, ``threshold_epsilon``,
    ``threshold_halving``."""
    from mlemlib.map_metrics import converged_map, reconstruct_with_metrics, series, time_to_threshold
    from mlemlib.problem import ModelSpec, RunSettings

    th = case.threshold
    assert th is not None
    matrix, directory = prep.matrix, prep.directory
    files = simulated(matrix, directory, th)
    settings = prior_settings(prior, prep.norm, files, th.subset_halving)
    model = ModelSpec(os.fspath(matrix), os.fspath(files["g"]), subsets=prep.subsets,
                      multiplicative=os.fspath(files["m"]), additive=os.fspath(files["b"]), map=settings)
    key = settings_key({"matrix": {"path": "converged"}, "beta": settings.beta, "epsilon": settings.epsilon,
                        "passes": th.converged_passes, "sim": files["g"].parent.name})
    cache = directory / f"converged-{key}.h5"
    log.info("%s: the converged MAP image (%d passes, %s)", case.name, th.converged_passes, cache)
    converged_map(model, cache, passes=th.converged_passes,
                  settings=RunSettings(th.converged_passes, checkpoint_every=0, backend=case.backend))
    runs = directory / "threshold-runs"
    runs.mkdir(exist_ok=True)
    out = runs / f"{prior}-{gpus}.h5"
    timings = reconstruct_with_metrics(model, RunSettings(th.passes, checkpoint_every=0, backend=case.backend,
                                                          gpus=gpus),
                                       out, converged=cache, truth=files["truth"], raw_out=False, timings_out=False)
    out.unlink(missing_ok=True)
    record = timings["map"]["metrics"]
    samples = timings["repetitions"][-1]["samples"]["iteration"]
    found = time_to_threshold(series(record), samples)
    row = {"threshold_passes": th.passes, "converged_passes": th.converged_passes,
           "threshold_beta": settings.beta, "threshold_epsilon": settings.epsilon,
           "threshold_halving": list(th.subset_halving),
           "threshold_pass_ms": 1e3 * float(np.median(samples)),
           "passes_to_threshold": found["passes"] if found else None,
           "seconds_to_threshold": found["seconds"] if found else None}
    log.info("%s, %s on %d device(s): %s", case.name, prior, gpus,
             f"thresholds met at pass {found['passes']} after {found['seconds']:.4f} s" if found
             else f"thresholds not met in {th.passes} passes")
    return row


def has_threshold(row: dict[str, Any]) -> bool:
    """Whether a result row holds a time to threshold, or the reason it has none (its columns then appear)."""
    return "threshold_passes" in row or "threshold_error" in row


def threshold_text(row: dict[str, Any]) -> str:
    """The page's cell: ``pass P, S s`` or ``not in N passes`` (``-`` for a row without a threshold)."""
    if "threshold_passes" not in row:
        return "-"
    p, s = row.get("passes_to_threshold"), row.get("seconds_to_threshold")
    if p is None or s is None or not math.isfinite(float(s)):
        return f"not in {row['threshold_passes']} passes"
    return f"pass {int(p)}, {float(s):.3f} s"
