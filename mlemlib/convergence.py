"""The convergence study: image quality per pass of MLEM and OSEM, and the bias of ignoring ``m`` and ``b`` (cpu, cuda).

Provides

- :func:`study` — reconstructs one simulated measurement with every subset
  count S of a list (S = 1: MLEM), each for the same number of passes (a pass
  visits all S subsets: one MLEM iteration), and records every
  ``record_every`` passes the image's contrast recovery in the phantom's hot
  and cold regions, its relative L2 error against the phantom and its
  centre-to-edge ratio (:func:`pass_metrics`); with ``ignore_corrections``
  also the same reconstructions of the same data with ``m = 1`` and ``b = 0``,
  to show the bias of a reconstruction that models neither. It writes one
  JSON record (:data:`FORMAT`), which :mod:`mlemlib.report` tabulates and
  plots.
- :func:`passes_to_reach` — the first recorded pass whose value reaches a
  target (the table's "passes to reach MLEM's contrast recovery").

The reconstructions are :func:`mlemlib.mlem.reconstruct` itself, on the matrix
grouped by each S's subsets (:func:`mlemlib.reorder.reorder_file` with
``mode="none"``: rows grouped by subset, nothing else renumbered), written to a
scratch folder that is removed at the end. The metrics are computed on the
host from the image that ``reconstruct``'s ``progress`` callback hands over:
on a GPU one copy of the image to the host per recorded pass (``n`` float32
values, a synchronisation) plus NumPy reductions over the image; the timed
runs of the workflow (``run_mlem``) never pay it.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mlemlib._io import atomic_path
from mlemlib.errors import ConfigError, InputError

log = logging.getLogger(__name__)

#: The ``format`` of a study's JSON record.
FORMAT = "mlem-convergence"
VERSION = 1

#: Fractions of the body's radius: the central background (around the lung
#: insert of the NEMA-like phantom, inside the ring of spheres) and the peripheral one.
CENTRE_RADIUS = 0.4
EDGE_RADIUS = 0.75


def passes_to_reach(passes: Sequence[int], values: Sequence[float], target: float | None) -> int | None:
    """The first of ``passes`` whose value is at least ``target`` (None: never, or no target).

    With metrics recorded every k passes the answer is a multiple of k: an
    upper bound, at most k - 1 passes late.
    """
    if target is None or not math.isfinite(target):
        return None
    for p, v in zip(passes, values):
        if v is not None and math.isfinite(v) and v >= target:
            return int(p)
    return None


def _mean_cr(cr: dict[str, float], labels: Iterable[str]) -> float:
    vals = [cr[k] for k in labels if k in cr and math.isfinite(cr[k])]
    return float(np.mean(vals)) if vals else math.nan


class _Yardstick:
    """What every pass is measured against: the truth, its regions and the central and peripheral background."""

    def __init__(self, truth: np.ndarray, regions: Any, grid: Sequence[int], voxel_size: Sequence[float]):
        self.truth = np.asarray(truth, dtype=np.float64).reshape(-1)
        self.regions = regions
        self.grid = tuple(int(v) for v in grid)
        bg = regions.background.reshape(-1)
        self.hot = [k for k, a in regions.activity.items() if a > regions.background_activity]
        self.cold = [k for k, a in regions.activity.items() if a < regions.background_activity]
        gx, gy, gz = self.grid
        vx, vy, _ = (float(v) for v in voxel_size)
        x = (np.arange(gx) + 0.5 - gx / 2) * vx
        y = (np.arange(gy) + 0.5 - gy / 2) * vy
        r = np.broadcast_to(np.hypot(x[None, :], y[:, None])[None], (gz, gy, gx)).reshape(-1)
        t = self.truth
        # Voxels at the background's activity (antialiased edges and inserts left out): their radius sets
        # the body's, and the centre and the edge are those within and beyond fractions of it.
        level = float(np.median(t[bg])) if bg.any() else 0.0
        plain = (np.abs(t - level) <= 0.05 * level) if level > 0 else np.zeros_like(bg)
        body = float(r[plain].max()) if plain.any() else 0.0
        self.centre = plain & (r <= CENTRE_RADIUS * body)
        self.edge = plain & (r >= EDGE_RADIUS * body)
        self.truth_ratio = (t[self.centre].mean() / t[self.edge].mean()
                            if self.centre.any() and self.edge.any() else math.nan)

    def metrics(self, image: np.ndarray) -> dict[str, Any]:
        """:func:`pass_metrics` of one image (user's voxel order)."""
        from mlemlib import metrics

        f = np.asarray(image, dtype=np.float64).reshape(-1)
        reg = self.regions
        cr = metrics.contrast_recovery(f, reg.masks, reg.background, reg.activity, reg.background_activity)
        edge = f[self.edge].mean() if self.edge.any() else math.nan
        ratio = f[self.centre].mean() / edge / self.truth_ratio if self.centre.any() and edge > 0 else math.nan
        return {"crc_hot": _mean_cr(cr, self.hot), "crc_cold": _mean_cr(cr, self.cold),
                "rel_error": metrics.relative_l2(f, self.truth), "centre_to_edge": float(ratio),
                "contrast_recovery": cr}

    def profile(self, image: np.ndarray) -> list[float]:
        """The mean along x through the centre: the rows within one voxel of y = 0 and the slices of the middle half in z."""
        gx, gy, gz = self.grid
        img = np.asarray(image, dtype=np.float64).reshape(gz, gy, gx)
        y0, z0 = gy // 2, gz // 2
        ys = slice(max(0, y0 - 1), min(gy, y0 + 1))
        zs = slice(max(0, z0 - max(1, gz // 4)), min(gz, z0 + max(1, gz // 4)))
        return [float(v) for v in img[zs, ys, :].mean(axis=(0, 1))]


def pass_metrics(image: Any, truth: Any, regions: Any, grid: Sequence[int], voxel_size: Sequence[float]) -> dict[str, Any]:
    """The measures a study records per pass, for one image against a phantom.

    Returns ``crc_hot`` and ``crc_cold`` (the mean contrast recovery,
    :func:`mlemlib.metrics.contrast_recovery`, of the regions hotter and colder
    than the background; 1 is perfect), ``rel_error`` (relative L2 error
    against the truth), ``centre_to_edge`` (the mean over the voxels at the
    background's activity within :data:`CENTRE_RADIUS` of the body's radius,
    over that beyond :data:`EDGE_RADIUS`, divided by the same ratio
    of the truth: 1 is unbiased, below 1 a centre too dark, as without
    attenuation correction) and ``contrast_recovery`` (each region's).
    """
    return _Yardstick(truth, regions, grid, voxel_size).metrics(image)


def _host(image: Any) -> np.ndarray:
    """A device image as a NumPy array (CuPy's ``get``; a NumPy array as it is); a list (the multi-GPU and
    OSEM backends' replicated image, the same on every GPU) by its first."""
    if isinstance(image, (list, tuple)):
        image = image[0]
    return image.get() if hasattr(image, "get") and not isinstance(image, np.ndarray) else np.asarray(image)


def _check_list(name: str, values: Any) -> list[int]:
    if isinstance(values, (int, np.integer)) and not isinstance(values, bool):
        values = [values]
    if not isinstance(values, (list, tuple)) or not values:
        raise ConfigError(name, f"must be a non-empty list of integers >= 1, got {values!r}")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) < 1:
            raise ConfigError(name, f"must be a non-empty list of integers >= 1, got {values!r}")
        if int(v) not in out:
            out.append(int(v))
    return out


def study(
    matrix: str | os.PathLike,
    sino: str | os.PathLike,
    truth: str | os.PathLike,
    out: str | os.PathLike,
    *,
    subsets: Sequence[int] = (1, 4, 8, 16),
    iterations: int = 50,
    record_every: int = 1,
    multiplicative: Any | None = None,
    additive: Any | None = None,
    ignore_corrections: bool = True,
    backend: str = "cpu",
    fp: str = "auto",
    bp: str = "auto",
    threads: int | None = None,
    matrix_name: str | None = None,
    data_name: str | None = None,
    scratch: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Run the convergence study of one simulated measurement and write its JSON record to ``out``.

    Parameters
    ----------
    matrix
        The user's matrix container (``mlem convert``; not reordered: each S
        groups its rows itself).
    sino, truth
        The measurement and the phantom's ``truth.h5`` (with its regions: a
        ``nema`` or ``uniform`` phantom; a cold-bodied ``derenzo`` has no contrast
        recovery and records NaN).
    out
        The JSON record to write.
    subsets
        The subset counts S to run (1: MLEM, the yardstick of "passes to reach").
    iterations
        Passes per reconstruction (a pass: all S subsets).
    record_every
        Record the metrics every k passes (and after the last).
    multiplicative, additive
        The measurement's ``m`` and ``b`` (as :func:`mlemlib.mlem.reconstruct` takes them).
    ignore_corrections
        Also reconstruct each S with ``m = 1`` and ``b = 0`` (the biased runs).
    backend, fp, bp, threads
        As :func:`mlemlib.mlem.reconstruct`'s (one GPU with ``cuda``).
    scratch
        Where the grouped matrices go while the study runs (default: a
        temporary folder beside ``out``); removed at the end.

    Returns
    -------
    dict
        The record: ``format``, ``matrix``, ``data``, ``iterations``,
        ``record_every``, ``subsets``, ``corrections`` (the factor files),
        ``profile_truth``, ``truth_centre_to_edge`` and ``series``: one entry
        per reconstruction with ``subsets``, ``corrected`` (False: m and b
        ignored), ``passes`` and per pass ``crc_hot``, ``crc_cold``,
        ``rel_error``, ``centre_to_edge``, the regions' ``contrast_recovery``,
        its final image's ``profile`` and ``seconds`` (the whole reconstruction,
        metrics included).

    Raises
    ------
    ConfigError
        A bad list of subsets, iteration count or ``record_every``, or a truth without regions.
    """
    from mlemlib.image import read_image
    from mlemlib.mlem import reconstruct
    from mlemlib.phantom import load_regions
    from mlemlib.problem import ModelSpec, RunSettings, check_int
    from mlemlib.reorder import image_to_user_order, permutation_of, reorder_file

    counts = _check_list("convergence.subsets", list(subsets))
    iterations = check_int("convergence.iterations", iterations, 1)
    every = check_int("convergence.record_every", record_every, 1)
    settings = RunSettings(iterations, checkpoint_every=0, backend=backend, fp=fp, bp=bp, threads=threads)
    t_img, attrs = read_image(truth)
    grid, vs = attrs.get("grid"), attrs.get("voxel_size")
    regions = load_regions(attrs, grid, vs) if grid is not None and vs is not None else None
    if regions is None:
        raise ConfigError(os.fspath(truth), "has no phantom regions (or no grid): no contrast recovery to record")
    yard = _Yardstick(t_img, regions, grid, vs)
    models = [(True, multiplicative, additive)]
    if ignore_corrections and (multiplicative is not None or additive is not None):
        models.append((False, None, None))
    elif ignore_corrections:
        log.info("the measurement has neither m nor b: no biased run (it would be the corrected one)")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".convergence-", dir=scratch if scratch is not None else out.parent))
    series: list[dict[str, Any]] = []
    try:
        for s in counts:
            grouped = os.fspath(matrix)
            if s > 1:
                grouped = os.fspath(work / f"osem{s}.h5")
                reorder_file(matrix, grouped, "none", subsets=s, threads=threads)
            perm = _permutation(grouped, permutation_of)
            for corrected, m, b in models:
                recorded: dict[str, list] = {k: [] for k in ("passes", "crc_hot", "crc_cold", "rel_error",
                                                             "centre_to_edge", "contrast_recovery")}

                def note(_rep: int, it: int, image: Any, _rec: dict = recorded, _perm: Any = perm) -> None:
                    if it % every and it != iterations:
                        return
                    host = _host(image)
                    if _perm is not None:
                        host = image_to_user_order(host, _perm)
                    _rec["passes"].append(it)
                    for k, v in yard.metrics(host).items():
                        _rec[k].append(v)

                t0 = time.perf_counter()
                image_path = work / f"osem{s}-{'corrected' if corrected else 'ignored'}.h5"
                model = ModelSpec(grouped, sino, subsets=s, multiplicative=m, additive=b, matrix_name=matrix_name,
                                  data_name=data_name)
                reconstruct(model, settings, image_path, raw_out=False, timings_out=False, progress=note)
                final, _ = read_image(image_path)
                seconds = time.perf_counter() - t0
                series.append({"subsets": s, "corrected": corrected, **recorded, "profile": yard.profile(final),
                               "seconds": seconds})
                log.info("S = %d%s: %d passes in %.2f s, contrast recovery (hot) %.4f, rel. error %.4f", s,
                         "" if corrected else " (m, b ignored)", iterations, seconds, recorded["crc_hot"][-1],
                         recorded["rel_error"][-1])
            if s > 1:
                Path(grouped).unlink(missing_ok=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    record = {
        "format": FORMAT, "version": VERSION,
        "matrix": matrix_name or Path(matrix).parent.name, "data": data_name or Path(sino).stem,
        "iterations": iterations, "record_every": every, "subsets": counts, "backend": backend,
        "corrections": {"multiplicative": None if multiplicative is None else os.fspath(multiplicative),
                        "additive": None if additive is None else os.fspath(additive)},
        "hot_regions": yard.hot, "cold_regions": yard.cold,
        "profile_truth": yard.profile(yard.truth), "voxel_size": [float(v) for v in vs], "grid": list(yard.grid),
        "series": series,
    }
    import json

    with atomic_path(out) as tmp:
        tmp.write_text(json.dumps(record, indent=1, allow_nan=True) + "\n", encoding="utf-8")
    return record


def _permutation(path: str, permutation_of: Any) -> Any:
    from mlemlib.formats import open_source

    src = open_source(path, "matrix")
    try:
        return permutation_of(src)
    finally:
        close = getattr(src, "close", None)
        if close is not None and src is not path:
            close()


def read_study(path: str | os.PathLike) -> dict[str, Any]:
    """A study's JSON record, checked (one line naming the file where it is not one)."""
    import json

    try:
        d = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(path, "no such file") from None
    except (OSError, ValueError) as exc:
        raise InputError(path, f"not a readable JSON file ({exc})") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT or not isinstance(d.get("series"), list):
        raise InputError(path, f"not a convergence record (format {FORMAT!r} with 'series')")
    return d


def study_rows(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per reconstruction of every study: the table of the summary (``convergence.csv``).

    Columns: ``matrix``, ``data``, ``subsets``, ``corrections`` (``modelled`` or
    ``ignored``: m = 1, b = 0), ``passes``, ``passes_to_mlem_crc`` (the first
    recorded pass whose hot contrast recovery reaches that of the corrected
    MLEM run after its last pass; empty without an MLEM run, where never
    reached, and for the runs that ignore m and b), ``mlem_crc_hot`` (that target), the final ``crc_hot``,
    ``crc_cold``, ``rel_error`` and ``centre_to_edge``, the lowest
    ``min_rel_error`` with its ``min_rel_error_pass``, and ``seconds``.
    """
    rows = []
    for rec in records:
        mlem = next((s for s in rec["series"] if s["subsets"] == 1 and s["corrected"] and s["crc_hot"]), None)
        target = mlem["crc_hot"][-1] if mlem is not None else None
        for s in rec["series"]:
            errors = [e if e is not None and math.isfinite(e) else math.inf for e in s["rel_error"]]
            best = int(np.argmin(errors)) if errors else None
            rows.append({
                "matrix": rec["matrix"], "data": rec["data"], "subsets": s["subsets"],
                "corrections": "modelled" if s["corrected"] else "ignored",
                "passes": s["passes"][-1] if s["passes"] else None,
                "passes_to_mlem_crc": passes_to_reach(s["passes"], s["crc_hot"], target) if s["corrected"] else None,
                "mlem_crc_hot": target,
                "crc_hot": s["crc_hot"][-1] if s["crc_hot"] else None,
                "crc_cold": s["crc_cold"][-1] if s["crc_cold"] else None,
                "rel_error": s["rel_error"][-1] if s["rel_error"] else None,
                "centre_to_edge": s["centre_to_edge"][-1] if s["centre_to_edge"] else None,
                "min_rel_error": s["rel_error"][best] if best is not None else None,
                "min_rel_error_pass": s["passes"][best] if best is not None else None,
                "seconds": s.get("seconds"),
            })
    return rows


#: The columns of ``convergence.csv`` (:func:`study_rows`).
STUDY_COLUMNS = ("matrix", "data", "subsets", "corrections", "passes", "passes_to_mlem_crc", "mlem_crc_hot", "crc_hot",
                 "crc_cold", "rel_error", "centre_to_edge", "min_rel_error", "min_rel_error_pass", "seconds")
