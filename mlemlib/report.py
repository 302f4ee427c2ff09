"""Summary of many runs: ``runs.csv``, Markdown and HTML tables, PNG plots (host; csv, matplotlib Agg).

:func:`summarize` reads the ``timings.json`` of every run (and of the float64
references), the transposition records (``transpose.h5`` attributes and
Snakemake benchmark ``.tsv`` files), the partition plans and the SpMV
benchmark tables, and writes:

``runs.csv``
    One row per run and repetition: every configuration dimension and every
    measure (see :data:`RUN_COLUMNS`; ``cr_<label>`` columns follow for the
    contrast recovery of each phantom insert). Besides the times and
    bandwidths: the matrix format and its bytes per non-zero on the device,
    the GPUs' theoretical and measured copy bandwidth (all GPUs together),
    and the GPUs' energy per repetition and per iteration and mean power
    (NVML, :class:`mlemlib.devices.EnergyMeter`; empty where not measured).
``summary.md``
    Time per iteration by step (as the thesis's Table 9.3; with the format,
    bytes per non-zero and, where measured, energy per iteration), the
    scaling over GPU counts and layouts (speed-up, parallel efficiency,
    bandwidth per GPU; only where a cuda configuration ran on more than one
    GPU count), the thesis beside us (only where a run's matrix has the shape
    of a thesis matrix, :mod:`mlemlib.thesis`: the thesis's run and each of
    our configurations, speed-up over the thesis, the ratio of aggregate
    theoretical memory bandwidths and the speed-up beyond it), the
    spread of the accuracy over repetitions, transposition times by method
    (the transposition alone and the whole job, side by side), partition
    balance, the SpMV benchmark.
``summary.html``, ``runs.html``
    The same two as HTML pages, for the Snakemake report (whose viewer
    shows HTML and images, but offers CSV and Markdown only as links that
    open blank).
``plots/time_per_iteration.png``
    Mean time per iteration of each configuration, stacked by step, with
    each repetition's mean as a circle; legend outside the axes, a key to
    the configuration labels below.
``plots/time_distribution.png``
    Box plot of every iteration's time by configuration; the boxes and
    whiskers set the scale, outliers beyond it are marked at the edge with
    their times.
``plots/accuracy.png``
    Image sum relative to the reference's, ``(S - S_ref) / S_ref``, and the
    relative L2 error to the reference, per repetition (the thesis's Figures
    9.4 and 9.12 show the spread of the image sum). Without a float64
    reference the sums are relative to the mean of the problem's runs.
``plots/scaling.png``
    Speed-up against the number of GPUs, one line per configuration and
    layout, with the ideal speed-up (y = P). Written only when some cuda
    configuration has a 1-GPU run and a run on more GPUs; the workflow
    declares ``plots/`` as a directory, so a missing file is no error.
``plots/time_vs_gpus.png``
    Time per iteration (ms) against the number of GPUs, one line per
    configuration and layout through the means over repetitions, each
    repetition's mean a circle, and a star for the thesis's run where a
    run's matrix has a thesis matrix's shape. Written where a cuda run is.
``plots/image_<matrix>_<data>.png``
    Central slices (axial, coronal, sagittal) of a reconstruction beside the
    truth, one per problem: axes in mm, one grey scale for both, its units.

The file names are stable; the workflow's report captions refer to them
(``report/plots.rst`` shows whichever of them exist).
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from mlemlib._io import atomic_dir, atomic_path
from mlemlib.errors import InputError
from mlemlib.metrics import spread
from mlemlib.mlem import transpose_used
from mlemlib.timing import format_seconds, ordered_steps

log = logging.getLogger(__name__)

#: Steps reported in the tables, in order.
STEPS = ("fp", "corr", "bp", "update", "allreduce")

#: The fixed columns of ``runs.csv`` (``cr_<label>`` columns follow).
RUN_COLUMNS = (
    "run", "matrix", "data", "backend", "fp", "bp", "transpose", "secsize", "gpus", "layout", "graph", "dtype",
    "reference_mode", "iterations", "repetition", "deterministic", "device", "format", "bytes_per_nnz",
    "iteration_mean_s", "iteration_median_s", "iteration_min_s", "iteration_max_s", "iteration_std_s",
    *(f"{s}_{k}_s" for s in STEPS for k in ("mean", "median", "min", "max")),
    "load_s", "setup_s", "wall_s", "bytes_per_iteration", "bandwidth_GBps", "fp_bandwidth_GBps",
    "bp_bandwidth_GBps", "gpu_bandwidth_theoretical_GBps", "gpu_bandwidth_measured_GBps",
    "of_floor", "of_csr_floor", "energy_J", "energy_per_iteration_J", "power_W", "energy_gpus",
    "power_capped_s", "thermal_capped_s",
    "image_sum", "reference_sum", "rel_l2_reference", "sum_rel_error_reference", "rel_l2_truth", "image_sha256", "resumed_at",
)

_TRANSPOSE_METHODS = ("scantrans", "scipy", "cusparse")


# --------------------------------------------------------------------------- loading
def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            d = json.load(fh)
    except FileNotFoundError:
        raise InputError(path, "no such file") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(path, f"not a readable JSON file ({exc})") from None
    if not isinstance(d, dict) or "repetitions" not in d or "config" not in d:
        raise InputError(path, "not a timings.json written by mlem reconstruct (no 'config'/'repetitions')")
    return d


def load_timings(items: Iterable[Any]) -> list[tuple[str, dict[str, Any]]]:
    """Collect ``(run id, timings)`` pairs.

    Parameters
    ----------
    items
        ``timings.json`` paths, run directories (searched recursively for
        ``timings.json``) or already-loaded timings dicts.

    Raises
    ------
    InputError
        A path that does not exist or a file that is not a timings record.
    """
    out: list[tuple[str, dict[str, Any]]] = []
    for k, item in enumerate(items):
        if isinstance(item, Mapping):
            if "repetitions" not in item or "config" not in item:
                raise InputError(f"<timings {k}>", "not a timings record (no 'config'/'repetitions')")
            out.append((str(item.get("run", f"run{k}")), dict(item)))
            continue
        p = Path(item)
        if p.is_dir():
            found = sorted(p.rglob("timings.json"))
            if not found:
                log.warning("%s: no timings.json below this directory", p)
            out += [(os.fspath(f.parent), _read_json(f)) for f in found]
        elif p.exists():
            out.append((os.fspath(p.parent), _read_json(p)))
        else:
            raise InputError(p, "no such file or directory")
    return out


# --------------------------------------------------------------------------- rows
def _num(v: Any) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _device_name(t: dict[str, Any]) -> str:
    dev = t.get("device")
    if isinstance(dev, list):
        names = [d.get("name", "?") if isinstance(d, dict) else str(d) for d in dev]
        return f"{len(names)}x {names[0]}" if names else ""
    if isinstance(dev, dict):
        return str(dev.get("name", ""))
    return str(dev or "")


def run_gpus(t: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The device dicts of the GPUs of a cuda run (the backend's ``device`` or ``devices``); empty for the CPU."""
    if _family((t.get("config") or {}).get("backend")) != "cuda":
        return []
    be = t.get("backend") if isinstance(t.get("backend"), dict) else {}
    devs = next((d for d in (be.get("devices"), be.get("device"), t.get("device")) if d), None)
    if isinstance(devs, dict):
        devs = [devs]
    return [d for d in devs or [] if isinstance(d, dict)]


def _copy_bandwidth(d: Mapping[str, Any]) -> float | None:
    cb = d.get("copy_bandwidth")
    return _num(cb.get("bandwidth")) if isinstance(cb, dict) else _num(cb)


def gpu_bandwidth_sum(devs: list[dict[str, Any]], gpus: Any, key: str) -> float | None:
    """Bytes/s of all the run's GPUs: ``theoretical_bandwidth`` or the measured ``copy_bandwidth`` (``key``).

    The sum over the GPUs, as the mean of the known ones times the run's GPU
    count ``gpus``: the same where every GPU is recorded, and the estimate for
    a run under the one-GPU-per-process launcher, whose ``timings.json``
    (rank 0's) records only its own GPU. None where no GPU has the figure.
    """
    get = _copy_bandwidth if key == "copy_bandwidth" else (lambda d: _num(d.get(key)))
    vals = [v for v in (get(d) for d in devs) if v is not None]
    if not vals:
        return None
    count = int(_num(gpus) or len(devs))
    return float(np.mean(vals)) * max(count, len(devs))


def csr_pair_bytes(shape: Any, nnz: Any) -> int | None:
    """Bytes of ``A`` and ``A^T`` as CSR, read once each: what an iteration on the CSR pair must move."""
    try:
        m, n = (int(v) for v in shape)
        k = int(nnz)
    except (TypeError, ValueError):
        return None
    return 8 * (m + 1) + 8 * k + 8 * (n + 1) + 8 * k


def floor_fractions(t: Mapping[str, Any], seconds: Any, copy_bandwidth: Any) -> tuple[float | None, float | None]:
    """Fractions of the run's own floor and of the CSR floor, at the copy bandwidth measured in the run.

    Own floor: the bytes an iteration reads (``timings["bytes"]["iteration"]``,
    in the format on the device) over the GPUs' measured copy bandwidth; CSR
    floor: :func:`csr_pair_bytes` over the same. Each is the floor's time
    over the iteration's mean time (1: at the floor; a CSR-floor fraction
    above 1 is faster than any iteration that reads the CSR pair can be).
    None where the run measured no copy bandwidth (the CPU).
    """
    sec, bw = _num(seconds), _num(copy_bandwidth)
    if not sec or not bw:
        return None, None
    own = _num((t.get("bytes") or {}).get("iteration"))
    csr = csr_pair_bytes(t.get("shape"), t.get("nnz"))
    return (own / bw / sec if own else None), (csr / bw / sec if csr else None)


def run_rows(timings: Iterable[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per run and repetition (the rows of ``runs.csv``)."""
    rows = []
    for run_id, t in timings:
        cfg = t.get("config", {})
        be = t.get("backend", {}) if isinstance(t.get("backend"), dict) else {}
        nbytes = t.get("bytes", {}) or {}
        setup = t.get("setup", {}) or {}
        devs = run_gpus(t)
        theo = gpu_bandwidth_sum(devs, cfg.get("gpus"), "theoretical_bandwidth")
        measured = gpu_bandwidth_sum(devs, cfg.get("gpus"), "copy_bandwidth")
        bpn = be.get("bytes_per_nnz")
        for rep in t.get("repetitions", []):
            steps = rep.get("steps", {})
            acc = rep.get("accuracy", {}) or {}
            row: dict[str, Any] = {
                "run": run_id,
                "matrix": cfg.get("matrix"),
                "data": cfg.get("data"),
                "backend": cfg.get("backend"),
                "fp": cfg.get("fp"),
                "bp": cfg.get("bp"),
                "transpose": transpose_used(be.get("transpose"), cfg.get("transpose") is not None),
                "secsize": cfg.get("secsize"),
                "gpus": cfg.get("gpus"),
                "layout": cfg.get("layout"),
                # Graph capture: the run's config, or (as mlem reconstruct records it) the backend's describe().
                "graph": bool(cfg.get("graph", be.get("graph", False))),
                "dtype": cfg.get("dtype"),
                "reference_mode": bool(cfg.get("reference_mode", False)),
                "iterations": cfg.get("iterations", rep.get("iterations")),
                "repetition": rep.get("repetition"),
                "deterministic": bool(t.get("deterministic", be.get("deterministic", True))),
                "device": _device_name(t),
                "format": be.get("format"),
                "bytes_per_nnz": _num(bpn.get("A")) if isinstance(bpn, dict) else _num(bpn),
                "load_s": _num(setup.get("load_s")),
                "setup_s": _num(setup.get("backend_s")),
                "wall_s": _num(rep.get("wall_s")),
                "bytes_per_iteration": nbytes.get("iteration"),
                "image_sum": _num(acc.get("image_sum")),
                "reference_sum": _num(acc.get("reference_sum")),
                "rel_l2_reference": _num(acc.get("rel_l2_reference")),
                "sum_rel_error_reference": _num(acc.get("sum_rel_error_reference")),
                "rel_l2_truth": _num(acc.get("rel_l2_truth")),
                "image_sha256": acc.get("image_sha256"),
                "resumed_at": " ".join(str(v) for v in rep.get("resumed_at") or []) or None,
            }
            it = steps.get("iteration", {})
            for k in ("mean", "median", "min", "max", "std"):
                row[f"iteration_{k}_s"] = _num(it.get(k))
            for s in STEPS:
                st = steps.get(s, {})
                for k in ("mean", "median", "min", "max"):
                    row[f"{s}_{k}_s"] = _num(st.get(k))

            def bw(b: Any, sec: Any) -> float | None:
                b, sec = _num(b), _num(sec)
                return b / sec / 1e9 if b and sec else None

            row["bandwidth_GBps"] = bw(nbytes.get("iteration"), row["iteration_mean_s"])
            row["fp_bandwidth_GBps"] = bw(nbytes.get("fp"), row["fp_mean_s"])
            row["bp_bandwidth_GBps"] = bw(nbytes.get("bp"), row["bp_mean_s"])
            row["gpu_bandwidth_theoretical_GBps"] = theo / 1e9 if theo is not None else None
            row["gpu_bandwidth_measured_GBps"] = measured / 1e9 if measured is not None else None
            row["of_floor"], row["of_csr_floor"] = floor_fractions(t, row["iteration_mean_s"], measured)
            for k in ("energy_J", "energy_per_iteration_J", "power_W"):
                row[k] = _num(rep.get(k))
            row["energy_gpus"] = rep.get("energy_gpus") if row["energy_J"] is not None else None
            capped = rep.get("clock_capped_s") or {}  # the loop's seconds of clocks held down (devices.EnergyMeter)
            row["power_capped_s"], row["thermal_capped_s"] = _num(capped.get("power")), _num(capped.get("thermal"))
            for label, v in (acc.get("contrast_recovery") or {}).items():
                row[f"cr_{label}"] = _num(v)
            row["_samples"] = rep.get("samples", {})
            row["_outputs"] = t.get("outputs", {})
            row["_truth"] = cfg.get("truth")
            # The kernels as configured ("auto", "notrans" resolve per backend and GPU count).
            row["_fp_requested"] = cfg.get("fp_requested") or cfg.get("fp")
            row["_bp_requested"] = cfg.get("bp_requested") or cfg.get("bp")
            row["_shape"] = tuple(int(v) for v in t["shape"]) if isinstance(t.get("shape"), (list, tuple)) else None
            # A folded matrix (each distinct row once): the user's shape, and the rows it stores.
            fold = t.get("fold") if isinstance(t.get("fold"), dict) else None
            row["_stored_rows"] = row["_shape"][0] if fold and row["_shape"] else None
            if fold and row["_shape"]:
                row["_shape"] = (int(fold["user_rows"]), row["_shape"][1])
            row["_gpu_model"] = str(devs[0].get("name", "")) if devs else ""
            per_gpu = _mean(d.get("theoretical_bandwidth") for d in devs)
            row["_gpu_theoretical_GBps"] = per_gpu / 1e9 if per_gpu else None
            rows.append(row)
    return rows


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    extra = sorted({k for r in rows for k in r if k.startswith("cr_")})
    return list(RUN_COLUMNS) + extra


def write_runs_csv(rows: list[dict[str, Any]], path: str | os.PathLike) -> None:
    """Write ``runs.csv`` (atomically); floats with full precision, empty cells for missing values."""
    cols = _columns(rows)
    with atomic_path(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(cols)
        for r in rows:
            w.writerow(["" if r.get(c) is None else (repr(r[c]) if isinstance(r[c], float) else r[c]) for c in cols])


# --------------------------------------------------------------------------- grouping
_CONFIG_KEYS = ("matrix", "data", "backend", "fp", "bp", "transpose", "secsize", "graph", "gpus", "layout", "dtype",
                "reference_mode")


def config_label(r: Mapping[str, Any]) -> str:
    """Short name of a configuration, e.g. ``cuda csr_vector/notrans x2 thesis`` (``graph``: CUDA graph capture)."""
    if r.get("reference_mode"):
        return "reference (float64)"
    bp = f"{r.get('bp')}" + ("+AT" if r.get("transpose") and r.get("bp") != "notrans" else "")
    s = f"{r.get('backend')} {r.get('fp')}/{bp}"
    if r.get("secsize"):
        s += f" sec{r['secsize']}"
    if r.get("graph"):
        s += " graph"
    gpus = r.get("gpus") or 1
    if r.get("backend") != "cpu" or gpus != 1:
        s += f" x{gpus}"
        if gpus > 1:
            s += f" {r.get('layout')}"
    return s


def group_rows(rows: list[dict[str, Any]]) -> OrderedDict[tuple, list[dict[str, Any]]]:
    """Rows grouped by configuration (every dimension but the repetition), in first-seen order."""
    groups: OrderedDict[tuple, list[dict[str, Any]]] = OrderedDict()
    for r in rows:
        groups.setdefault(tuple(r.get(k) for k in _CONFIG_KEYS), []).append(r)
    return groups


def _mean(vals: Iterable[Any]) -> float | None:
    v = [x for x in (_num(y) for y in vals) if x is not None]
    return float(np.mean(v)) if v else None


# --------------------------------------------------------------------------- markdown
def _md_table(headers: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        return ("" if v is None else str(v)).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(h) for h in headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _fmt_s(v: Any) -> str:
    v = _num(v)
    return format_seconds(v) if v is not None else ""


def _fmt_g(v: Any, digits: int = 9) -> str:
    v = _num(v)
    return f"{v:.{digits}g}" if v is not None else ""


def _fmt_pct(v: Any) -> str:
    f = _num(v)
    return "" if f is None else f"{100 * f:.0f}%"


def _fmt_e(v: Any) -> str:
    v = _num(v)
    return f"{v:.3e}" if v is not None else ""


def timing_section(groups: Mapping[tuple, list[dict[str, Any]]]) -> str:
    """Markdown: time per iteration by step, one row per configuration, then a thesis-style table each.

    The ``format`` column gives the matrix format on the device and its bytes
    per non-zero of ``A`` where the backend recorded them; ``J/iteration``
    (the GPUs' energy per iteration, mean over repetitions) appears only
    where some run measured it.
    """
    energy = any(r.get("energy_per_iteration_J") is not None for rs in groups.values() for r in rs)
    floors = any(r.get("of_floor") is not None for rs in groups.values() for r in rs)
    head = ["matrix", "data", "configuration", "format", "reps", "iteration", "min", "max", *STEPS, "GB/s",
            *(["of floor", "of CSR floor"] if floors else []), *(["J/iteration"] if energy else []),
            "deterministic"]
    body = []
    for rs in groups.values():
        r0 = rs[0]
        body.append(
            [
                r0["matrix"], r0["data"], config_label(r0), _format_cell(r0), len(rs),
                _fmt_s(_mean(r["iteration_mean_s"] for r in rs)),
                _fmt_s(min((r["iteration_min_s"] for r in rs if r["iteration_min_s"] is not None), default=None)),
                _fmt_s(max((r["iteration_max_s"] for r in rs if r["iteration_max_s"] is not None), default=None)),
                *(_fmt_s(_mean(r[f"{s}_mean_s"] for r in rs)) for s in STEPS),
                _fmt_g(_mean(r["bandwidth_GBps"] for r in rs), 4),
                *([_fmt_pct(_mean(r.get("of_floor") for r in rs)), _fmt_pct(_mean(r.get("of_csr_floor") for r in rs))]
                  if floors else []),
                *([_fmt_g(_mean(r.get("energy_per_iteration_J") for r in rs), 4)] if energy else []),
                "yes" if r0["deterministic"] else "NO (atomics)",
            ]
        )
    intro = (
        "Mean over all iterations and repetitions (min and max: the fastest and slowest single iteration). "
        "format: the matrix format on the device, with its bytes per non-zero of A in brackets where recorded "
        "(CSR: 8, a 4-byte value and a 4-byte column, plus the row pointer); folded: the matrix stores each "
        "distinct row once (a LOR stored as (i, j) and (j, i) once), the same image from fewer bytes. "
        "GB/s: bytes the iteration reads over its mean time: A and A^T where stored (A twice without it; once "
        "in one pass), in the format on the device."
        + (" of floor: the time those bytes take at the GPUs' copy bandwidth measured in the run, over the "
           "iteration's time (100%: as fast as reading them can be); of CSR floor: the same for the bytes of A and "
           "A^T as CSR, read once each (above 100%: faster than any iteration on the CSR pair can be)."
           if floors else "")
        + (" J/iteration: the GPUs' energy per iteration from NVML's counters, mean over repetitions (empty: "
           "not measured, e.g. on the CPU)." if energy else "")
        + "\n\n"
    )
    out = ["## Time per iteration by step\n", intro, _md_table(head, body)]
    for rs in groups.values():
        r0 = rs[0]
        samples: dict[str, list[float]] = {}
        for r in rs:
            for step, vals in (r.get("_samples") or {}).items():
                samples.setdefault(step, []).extend(float(v) for v in vals if v is not None)
        if not samples:
            continue
        stats_rows = []
        for step in ordered_steps(samples):
            a = np.asarray(samples[step])
            if a.size:
                stats_rows.append((step, float(a.mean()), float(a.min()), float(a.max()), float(np.median(a))))
        its = [s for s in stats_rows if s[0] == "iteration"]
        steps_sorted = sorted((s for s in stats_rows if s[0] != "iteration"), key=lambda s: -s[1]) + its
        out.append(f"\n### {r0['matrix']} / {r0['data']}: {config_label(r0)}\n\n")
        out.append(
            _md_table(
                ["step", "avg time per iteration", "min", "max", "median"],
                [[s[0], _fmt_s(s[1]), _fmt_s(s[2]), _fmt_s(s[3]), _fmt_s(s[4])] for s in steps_sorted],
            )
        )
    return "".join(out)


def _format_cell(r: Mapping[str, Any]) -> str:
    """``compressed (5.04)``: the format and its bytes per non-zero of A (the format alone where unknown);
    ``, folded`` for a folded matrix."""
    fmt = r.get("format") or ""
    bpn = _num(r.get("bytes_per_nnz"))
    cell = f"{fmt} ({bpn:.3g})" if fmt and bpn is not None else (f"{bpn:.3g} B" if bpn is not None else fmt)
    return cell + (", folded" if r.get("_stored_rows") else "")


def accuracy_section(groups: Mapping[tuple, list[dict[str, Any]]]) -> str:
    """Markdown: accuracy and its spread over repetitions, per configuration."""
    head = ["matrix", "data", "configuration", "reps", "image sum (mean)", "min", "max", "std", "max-min",
            "rel. L2 to ref. (mean)", "min", "max", "rel. L2 to truth", "distinct images", "deterministic"]
    body = []
    cr_rows = []
    cr_labels = sorted({k for rs in groups.values() for r in rs for k in r if k.startswith("cr_")})
    for rs in groups.values():
        r0 = rs[0]
        sums = spread([r["image_sum"] for r in rs if r["image_sum"] is not None])
        rel = spread([r["rel_l2_reference"] for r in rs if r["rel_l2_reference"] is not None])
        digests = {r["image_sha256"] for r in rs if r.get("image_sha256")}
        body.append(
            [
                r0["matrix"], r0["data"], config_label(r0), len(rs),
                _fmt_g(sums["mean"]), _fmt_g(sums["min"]), _fmt_g(sums["max"]), _fmt_e(sums["std"]), _fmt_e(sums["range"]),
                _fmt_e(rel["mean"]), _fmt_e(rel["min"]), _fmt_e(rel["max"]),
                _fmt_e(_mean(r["rel_l2_truth"] for r in rs)),
                len(digests) if digests else "",
                "yes" if r0["deterministic"] else "NO (atomics)",
            ]
        )
        if cr_labels:
            cr_rows.append([r0["matrix"], r0["data"], config_label(r0), *(_fmt_g(_mean(r.get(c) for r in rs), 4) for c in cr_labels)])
    intro = (
        "Image sum: the thesis's measure (float64 sum). rel. L2: ||f - f_ref|| / ||f_ref|| against the float64 "
        "reference MLEM of the same problem, and against the phantom. distinct images: how many different "
        "float32 images the repetitions produced (1: bit-identical).\n\n"
    )
    out = ["## Accuracy over repetitions\n", intro, _md_table(head, body)]
    if cr_rows:
        out += ["\n### Contrast recovery (mean over repetitions; 1 is perfect)\n\n",
                _md_table(["matrix", "data", "configuration", *(c[3:] for c in cr_labels)], cr_rows)]
    return "".join(out)


def run_image(row: Mapping[str, Any]) -> Path | None:
    """The final image a run's ``timings.json`` names (None if it names none); where the run directory
    has moved since, the file of that name beside its ``timings.json``."""
    image = (row.get("_outputs") or {}).get("image")
    if not image:
        return None
    if not Path(image).exists():  # the run directory moved: look beside its timings.json
        return Path(row["run"]) / Path(image).name
    return Path(image)


def exact_reference_problem(path: str | os.PathLike) -> tuple[str, str]:
    """``(matrix, data)`` of an exact reference image, ``results/{matrix}/runs/{data}/reference-exact/image.h5``."""
    parts = Path(path).parts
    if len(parts) < 5 or parts[-2] != "reference-exact" or parts[-4] != "runs":
        raise InputError(path, "not results/{matrix}/runs/{data}/reference-exact/image.h5")
    return parts[-5], parts[-3]


def lossy_section(rows: Iterable[Mapping[str, Any]], exact_references: Iterable[Any]) -> str:
    """Markdown: what a lossy matrix format's values cost each image, against the exact matrix's reference.

    For each problem with an exact reference (the float64 MLEM on the
    lossless source of a ``compressed-f16`` / ``compressed-u16`` matrix), the
    relative L2 distance of every run's final image (and of the float64
    reference on the lossy matrix) to it, after the same iterations. Empty
    without exact references.
    """
    from mlemlib.image import read_image

    exact = {exact_reference_problem(p): read_image(p)[0].astype(np.float64) for p in exact_references}
    if not exact:
        return ""
    body = []
    seen: set[tuple] = set()
    for r in sorted(rows, key=lambda r: (not r.get("reference_mode"), config_label(r), r["run"])):
        key = (r.get("matrix"), r.get("data"))
        image = run_image(r)
        if key not in exact or image is None or (key, r["run"]) in seen:
            continue
        seen.add((key, r["run"]))
        ref64 = exact[key]
        img, _ = read_image(image, expected_length=ref64.size)
        rel = float(np.linalg.norm(img.astype(np.float64) - ref64) / (np.linalg.norm(ref64) or 1.0))
        body.append([key[0], key[1], config_label(r), r.get("format") or "", r.get("iterations") or "", _fmt_e(rel),
                     _fmt_e(r.get("rel_l2_reference"))])
    head = ["matrix", "data", "configuration", "format on the device", "iterations", "rel. L2 to the exact matrix's reference",
            "rel. L2 to its own reference"]
    intro = (
        "A matrix stored with lossy 16-bit values (compressed-f16, compressed-u16) is reconstructed from rounded "
        "values. Each run's final image (and the float64 reference MLEM of the stored matrix) against the "
        "float64 reference MLEM of the lossless matrix it was converted from, same measurement and iterations: "
        "what the rounding costs the image. Its own reference: the accuracy table's distance, from the same "
        "rounded matrix.\n\n"
    )
    return "## Accuracy cost of lossy matrix values\n\n" + intro + _md_table(head, body)


# --------------------------------------------------------------------------- scaling
def _family(backend: Any) -> str:
    """``cuda`` for ``cuda`` (one GPU) and ``cuda-nccl`` (several GPUs, or graph capture): one backend family."""
    return str(backend or "").split("-")[0]


def _scaling_key(r: Mapping[str, Any]) -> tuple:
    """Every configuration dimension but the GPU count and the layout (kernels as configured)."""
    return (r.get("matrix"), r.get("data"), _family(r.get("backend")), r.get("_fp_requested") or r.get("fp"),
            r.get("_bp_requested") or r.get("bp"), r.get("secsize"), bool(r.get("graph")), r.get("dtype"))


def _scaling_label(r: Mapping[str, Any]) -> str:
    """Name of a configuration without GPU count and layout, e.g. ``cuda csr_vector/csr_vector graph``."""
    s = f"{_family(r.get('backend'))} {r.get('_fp_requested') or r.get('fp')}/{r.get('_bp_requested') or r.get('bp')}"
    if r.get("secsize"):
        s += f" sec{r['secsize']}"
    if r.get("graph"):
        s += " graph"
    return s


def scaling_table(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Scaling records: per configuration, GPU count and layout, of cuda configurations run on several GPU counts.

    Runs are grouped by every configuration dimension but ``gpus`` and
    ``layout`` (the backend names ``cuda`` and ``cuda-nccl`` count as one;
    the kernels are the configured ones). In each group, per ``(gpus,
    layout)``:

    - ``iteration_s``: the mean over repetitions of ``iteration_mean_s``
      (as in the timing table), and ``<step>_s`` likewise where timed;
    - ``speedup`` = T(1) / T(P), T(1) the time of the group's 1-GPU run
      whatever its layout label (``local`` where there are several; the
      one-GPU ``cuda`` backend unless graph capture), None without one;
    - ``efficiency`` = speedup / P;
    - ``bandwidth_per_gpu_GBps`` = bytes_per_iteration / P / T(P) / 1e9:
      ``bytes_per_iteration`` counts the whole A (and A^T where stored),
      which the P GPUs read in nnz-balanced parts, about 1/P each;
    - ``rel_l2_reference``: mean over repetitions.

    Returns
    -------
    list of dict
        In first-seen order of the groups, by GPU count then layout within one;
        empty where no cuda configuration ran on more than one GPU count.
    """
    groups: OrderedDict[tuple, list[Mapping[str, Any]]] = OrderedDict()
    for r in rows:
        if r.get("reference_mode") or _family(r.get("backend")) != "cuda" or _num(r.get("gpus")) is None:
            continue
        groups.setdefault(_scaling_key(r), []).append(r)
    out: list[dict[str, Any]] = []
    for rs in groups.values():
        if len({int(r["gpus"]) for r in rs}) < 2:
            continue
        cells: OrderedDict[tuple[int, str], list[Mapping[str, Any]]] = OrderedDict()
        for r in sorted(rs, key=lambda r: (int(r["gpus"]), str(r.get("layout")))):
            cells.setdefault((int(r["gpus"]), str(r.get("layout"))), []).append(r)
        ones = [k for k in cells if k[0] == 1]
        base = (1, "local") if (1, "local") in cells else (ones[0] if ones else None)
        t1 = _mean(r["iteration_mean_s"] for r in cells[base]) if base else None
        for (p, layout), cs in cells.items():
            t = _mean(c["iteration_mean_s"] for c in cs)
            nbytes = _mean(c.get("bytes_per_iteration") for c in cs)
            speedup = t1 / t if t1 and t else None
            rec: dict[str, Any] = {
                "matrix": cs[0].get("matrix"), "data": cs[0].get("data"), "configuration": _scaling_label(cs[0]),
                "gpus": p, "layout": layout, "reps": len(cs), "iteration_s": t,
                **{f"{s}_s": _mean(c.get(f"{s}_mean_s") for c in cs) for s in STEPS},
                "speedup": speedup, "efficiency": speedup / p if speedup is not None else None,
                "bandwidth_per_gpu_GBps": nbytes / p / t / 1e9 if nbytes and t else None,
                "rel_l2_reference": _mean(c.get("rel_l2_reference") for c in cs),
                "deterministic": all(c.get("deterministic") for c in cs),
            }
            out.append(rec)
    return out


def _fmt_ratio(v: Any) -> str:
    v = _num(v)
    return f"{v:.2f}" if v is not None else "–"


def scaling_section(rows: Iterable[Mapping[str, Any]]) -> str:
    """Markdown: speed-up, parallel efficiency and bandwidth per GPU over GPU counts and layouts ("" if none)."""
    recs = scaling_table(rows)
    if not recs:
        return ""
    steps = [s for s in STEPS if any(r[f"{s}_s"] is not None for r in recs)]
    head = ["matrix", "data", "configuration", "GPUs", "layout", "reps", "iteration", *steps, "speed-up",
            "efficiency", "GB/s per GPU", "rel. L2 to ref.", "deterministic"]
    body = [
        [r["matrix"], r["data"], r["configuration"], r["gpus"], r["layout"], r["reps"], _fmt_s(r["iteration_s"]),
         *(_fmt_s(r[f"{s}_s"]) for s in steps), _fmt_ratio(r["speedup"]), _fmt_ratio(r["efficiency"]),
         _fmt_g(r["bandwidth_per_gpu_GBps"], 4), _fmt_e(r["rel_l2_reference"]),
         "yes" if r["deterministic"] else "NO (atomics)"]
        for r in recs
    ]
    intro = (
        "Every cuda configuration run on more than one GPU count, by GPU count P and layout. iteration and steps: "
        "mean time per iteration over all iterations and repetitions, as in the table above (graph capture times "
        "only the whole iteration). speed-up: T(1)/T(P), T(1) the configuration's 1-GPU run (– without one); "
        "efficiency: speed-up / P (1 is perfect). GB/s per GPU: bytes an iteration reads (as in the table above) "
        "/ P / T(P), each GPU reading its nnz-balanced part, about 1/P of them. rel. L2 to ref.: mean "
        "over repetitions.\n\n"
    )
    return "## Scaling over GPUs\n\n" + intro + _md_table(head, body)


# --------------------------------------------------------------------------- the thesis beside us
def _step_cell(r: Mapping[str, Any], step: str, fused_into: str | None) -> str:
    """A step's mean time; ``fused into <step>`` where the backend timed it inside another; – where not timed."""
    t = r.get(f"{step}_s")
    if t is not None:
        return _fmt_s(t)
    if fused_into and r.get(f"{fused_into}_s") is not None:
        return f"fused into {fused_into}"
    return "–"


def thesis_table(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Our configurations on a thesis matrix beside the thesis's run (:mod:`mlemlib.thesis`).

    For every published run whose matrix has the shape of some run of ours:
    first the thesis's record, then one per configuration of ours on that
    matrix (every configuration dimension, GPU count and layout included;
    the float64 reference left out), in first-seen order; ``beside`` holds
    the :class:`mlemlib.thesis.ThesisRun` of both. Each record has
    ``iteration_s`` and ``fp_s``, ``bp_s``, ``allreduce_s`` (mean over
    repetitions; None where not timed), ``gpus``, ``gpu_model``,
    ``theoretical_per_gpu_GBps``, ``theoretical_GBps`` (all GPUs),
    ``measured_GBps`` (our copy bandwidth, all GPUs), ``speedup`` = T_thesis /
    T_ours, ``bandwidth_ratio`` = ours / the thesis's aggregate theoretical
    bandwidth, ``kernel_gain`` = speedup / bandwidth_ratio, and
    ``energy_per_iteration_J``, ``energy_gpus``.
    """
    from mlemlib import thesis

    rows = [r for r in rows if not r.get("reference_mode")]
    out: list[dict[str, Any]] = []
    for run in thesis.RUNS:
        ours = [r for r in rows if r.get("_shape") == run.matrix.shape]
        if not ours:
            continue
        t_thesis = run.iteration_s
        theo_thesis = run.theoretical_bandwidth / 1e9
        out.append({
            "thesis": True, "beside": run, "matrix": run.matrix.name, "data": f"{run.table}, run {run.runs}x",
            "configuration": run.label, "reps": run.runs, "gpus": run.gpus, "gpu_model": run.gpu.model,
            "theoretical_per_gpu_GBps": run.gpu.theoretical_bandwidth / 1e9, "theoretical_GBps": theo_thesis,
            "measured_GBps": None, "iteration_s": t_thesis,
            **{f"{s}_s": run.steps.get(s) for s in STEPS},
            "speedup": 1.0, "bandwidth_ratio": 1.0, "kernel_gain": 1.0,
            "energy_per_iteration_J": None, "energy_gpus": None,
        })
        for rs in group_rows(ours).values():
            r0 = rs[0]
            t = _mean(r["iteration_mean_s"] for r in rs)
            theo = _mean(r.get("gpu_bandwidth_theoretical_GBps") for r in rs)
            speedup = t_thesis / t if t else None
            ratio = theo / theo_thesis if theo else None
            counted = {r.get("energy_gpus") for r in rs if r.get("energy_gpus") is not None}
            stored = r0.get("_stored_rows")
            matrix = r0["matrix"] + (f" (folded: each LOR once, {stored:,} stored rows)" if stored else "")
            out.append({
                "thesis": False, "beside": run, "matrix": matrix, "data": r0["data"],
                "configuration": config_label(r0),
                "reps": len(rs), "gpus": int(_num(r0.get("gpus")) or 1), "gpu_model": r0.get("_gpu_model") or "",
                "theoretical_per_gpu_GBps": r0.get("_gpu_theoretical_GBps"), "theoretical_GBps": theo,
                "measured_GBps": _mean(r.get("gpu_bandwidth_measured_GBps") for r in rs), "iteration_s": t,
                **{f"{s}_s": _mean(r.get(f"{s}_mean_s") for r in rs) for s in STEPS},
                "speedup": speedup, "bandwidth_ratio": ratio,
                "kernel_gain": speedup / ratio if speedup is not None and ratio else None,
                "energy_per_iteration_J": _mean(r.get("energy_per_iteration_J") for r in rs),
                "energy_gpus": min(counted) if counted else None,
            })
    return out


#: The sentence above the thesis table: what its columns compare.
THESIS_INTRO = (
    "The thesis's run on this matrix (first row; {table}: mean time per iteration of each step, 1 run of "
    "{iterations} iterations on {gpus} {model} GPUs of a {platform}, {bw:.1f} GB/s theoretical memory bandwidth "
    "each) beside each of our configurations on a matrix of the same shape ({rows:,} x {cols:,}). "
    "iteration: the thesis's is the sum of its steps. "
    "speed-up: the thesis's time per iteration over ours. bandwidth ratio: our GPUs' aggregate theoretical "
    "memory bandwidth over the thesis's ({total:.0f} GB/s), the speed-up the hardware alone would explain for "
    "a memory-bound iteration. kernel gain: speed-up / bandwidth ratio, the part of the speed-up that is not "
    "the hardware's (above 1: our kernels and layout do better per byte/s of memory bandwidth). "
    "measured copy: our GPUs' device-to-device copy bandwidth, all GPUs together, measured in the run. "
    "Our fp includes the correlation where it runs in the forward projection's epilogue, our bp the update "
    "where fused; a one-pass iteration has no separate fp (*fused into bp*); graph capture times only the "
    "whole iteration (–). J/iteration: the GPUs' energy per iteration (NVML), where measured.\n\n"
)


def thesis_section(rows: Iterable[Mapping[str, Any]]) -> str:
    """Markdown: the thesis beside us, only where a run's matrix has a thesis matrix's shape ("" otherwise)."""
    from mlemlib import thesis

    recs = thesis_table(rows)
    if not recs:
        return ""
    head = ["configuration", "matrix / data", "reps", "GPUs", "GPU", "GB/s per GPU (theor.)", "GB/s total (theor.)",
            "GB/s total (measured copy)", "iteration", "fp", "bp", "allreduce", "speed-up over thesis",
            "bandwidth ratio", "kernel gain", "J/iteration"]
    out = []
    for run in thesis.RUNS:
        body = []
        for r in (r for r in recs if r["beside"] is run):
            energy = _fmt_g(r["energy_per_iteration_J"], 4)
            if energy and r["energy_gpus"] is not None and r["energy_gpus"] < r["gpus"]:
                energy += f" ({r['energy_gpus']} of {r['gpus']} GPUs)"
            body.append([
                r["configuration"], f"{r['matrix']} / {r['data']}", r["reps"], r["gpus"], r["gpu_model"],
                _fmt_g(r["theoretical_per_gpu_GBps"], 5) or "–", _fmt_g(r["theoretical_GBps"], 5) or "–",
                _fmt_g(r["measured_GBps"], 5) or "–", _fmt_s(r["iteration_s"]),
                _step_cell(r, "fp", "bp"), _step_cell(r, "bp", None), _step_cell(r, "allreduce", None),
                _fmt_ratio(r["speedup"]), _fmt_ratio(r["bandwidth_ratio"]), _fmt_ratio(r["kernel_gain"]),
                energy or "–",
            ])
        if not body:
            continue
        intro = THESIS_INTRO.format(
            table=run.table, iterations=run.iterations, gpus=run.gpus, model=run.gpu.model, platform=run.platform,
            bw=run.gpu.theoretical_bandwidth / 1e9, rows=run.matrix.rows, cols=run.matrix.cols,
            total=run.theoretical_bandwidth / 1e9)
        out.append(f"## The thesis beside us: {run.matrix.name} ({run.matrix.table})\n\n" + intro
                   + _md_table(head, body))
    return "\n".join(out)


# --------------------------------------------------------------------------- other records
def read_benchmark_tsv(path: str | os.PathLike) -> dict[str, Any]:
    """Seconds and peak memory of a Snakemake ``benchmark:`` file (all its rows: mean, min, max)."""
    p = Path(path)
    try:
        with open(p, encoding="utf-8", newline="") as fh:
            recs = list(csv.DictReader(fh, delimiter="\t"))
    except OSError as exc:
        raise InputError(p, f"cannot read benchmark file ({exc})") from None
    secs = [_num(r.get("s")) for r in recs]
    secs = [s for s in secs if s is not None]
    if not secs:
        raise InputError(p, "no 's' column with seconds (not a Snakemake benchmark file)")
    rss = [_num(r.get("max_rss")) for r in recs]
    rss = [v for v in rss if v is not None]
    return {"n": len(secs), "mean_s": float(np.mean(secs)), "min_s": min(secs), "max_s": max(secs),
            "max_rss_MB": max(rss) if rss else None}


def _transpose_label(p: Path) -> tuple[str, str]:
    """(matrix, method) from ``.../{matrix}/transpose[-method].h5`` or ``.../{matrix}[-method].tsv``."""
    stem = p.name.split(".")[0]
    if stem.startswith("transpose"):
        method = stem[len("transpose-"):] if stem.startswith("transpose-") else ""
        return p.resolve().parent.name, method
    for meth in _TRANSPOSE_METHODS:
        if stem.endswith("-" + meth):
            return stem[: -len(meth) - 1], meth
    return stem, ""


def transpose_rows(transposes: Iterable[Any] = (), benchmarks: Iterable[Any] = ()) -> list[dict[str, Any]]:
    """Transposition records, one per matrix and method, from ``transpose.h5`` attributes and benchmark files.

    A ``transpose.h5`` gives ``transpose_s``, the transposition alone as
    measured inside the job (its ``seconds`` attribute), and ``threads``; the
    Snakemake benchmark of the job that wrote it gives the whole job's time
    (``job_n``, ``job_mean_s``, ``job_min_s``, ``job_max_s``, ``max_rss_MB``).
    Files are matched by name: ``results/{matrix}/transpose.h5`` with
    ``benchmarks/transpose/{matrix}.tsv`` (the configured method, the A^T the
    runs read: ``used_by_runs``), ``transpose-{method}.h5`` with
    ``{matrix}-{method}.tsv``.
    """
    recs: OrderedDict[tuple[str, str], dict[str, Any]] = OrderedDict()

    def rec(matrix: str, file_method: str) -> dict[str, Any]:
        return recs.setdefault((matrix, file_method), {
            "matrix": matrix, "method": file_method, "used_by_runs": not file_method, "transpose_s": None,
            "threads": None, "job_n": None, "job_mean_s": None, "job_min_s": None, "job_max_s": None,
            "max_rss_MB": None, "files": []})

    for path in transposes:
        import h5py

        p = Path(path)
        try:
            with h5py.File(p, "r") as f:
                attrs = {k: f.attrs[k] for k in f.attrs}
        except OSError as exc:
            raise InputError(p, f"not a readable HDF5 file ({exc})") from None
        matrix, file_method = _transpose_label(p)
        r = rec(matrix, file_method)
        meth = attrs.get("method", file_method)
        r["method"] = (meth.decode() if isinstance(meth, bytes) else str(meth)) or file_method
        r["transpose_s"] = _num(attrs.get("seconds"))
        r["threads"] = _num(attrs.get("threads"))
        r["files"].append(os.fspath(p))
    for path in benchmarks:
        p = Path(path)
        b = read_benchmark_tsv(p)
        matrix, file_method = _transpose_label(p)
        r = rec(matrix, file_method)
        r.update(job_n=b["n"], job_mean_s=b["mean_s"], job_min_s=b["min_s"], job_max_s=b["max_s"],
                 max_rss_MB=b["max_rss_MB"])
        r["files"].append(os.fspath(p))
    for r in recs.values():
        r["method"] = r["method"] or "(the configured method)"
    return list(recs.values())


#: What the columns of the transposition table measure (printed above it).
TRANSPOSE_INTRO = (
    "Two different times per method. **transposition alone**: the transposition of A in memory, timed inside "
    "the job (the `seconds` attribute of the transpose file); compare methods by this column. **whole job**: "
    "the Snakemake benchmark of the job that wrote the file (the mean where it ran several times), from process "
    "start to end: Python and library start-up (for scantrans also loading or compiling its Numba kernels), "
    "reading A, the transposition, checking and writing A^T. **rest of the job**: whole job minus transposition "
    "alone, the part that is not the method's work. The A^T the runs read (`transpose.method`, "
    "results/{matrix}/transpose.h5) is marked *yes*; the other methods (`transpose.compare`) are timed for this "
    "table only.\n\n"
)


def transpose_section(rows: list[dict[str, Any]]) -> str:
    """Markdown: transposition times by method, each column saying what it measures.

    ``jobs``, ``whole job min`` and ``max`` appear only where some method
    has more than one benchmark row.
    """
    if not rows:
        return ""
    several = any((r.get("job_n") or 0) > 1 for r in rows)
    head = ["matrix", "method", "A^T of the runs", "transposition alone", "threads", "whole job",
            "rest of the job", *(["jobs", "whole job min", "whole job max"] if several else []),
            "job's max RSS (MB)"]
    body = []
    for r in rows:
        rest = (r["job_mean_s"] - r["transpose_s"]
                if r.get("job_mean_s") is not None and r.get("transpose_s") is not None else None)
        spread_cells = [r.get("job_n") or "", _fmt_s(r.get("job_min_s")), _fmt_s(r.get("job_max_s"))]
        body.append([r["matrix"], r["method"], "yes" if r["used_by_runs"] else "", _fmt_s(r.get("transpose_s")),
                     _fmt_g(r.get("threads"), 3), _fmt_s(r.get("job_mean_s")), _fmt_s(rest),
                     *(spread_cells if several else []), _fmt_g(r.get("max_rss_MB"), 6)])
    return "## Transposition times by method\n\n" + TRANSPOSE_INTRO + _md_table(head, body)


def plan_section(plans: Iterable[Any]) -> str:
    """Markdown: nnz balance of the partition plans."""
    body = []
    for path in plans:
        p = Path(path)
        if p.is_dir():
            p = p / "plan.json"
        try:
            plan = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise InputError(p, f"not a readable plan.json ({exc})") from None
        nnz = plan.get("nnz_per_part") or []
        body.append([p.parent.parent.name, plan.get("parts"), plan.get("nnz"), _fmt_g(plan.get("imbalance"), 6),
                     _fmt_g(plan.get("transpose_imbalance"), 6), min(nnz) if nnz else "", max(nnz) if nnz else ""])
    if not body:
        return ""
    return "## Partitions (nnz balance)\n\nimbalance: largest part's non-zeros over the mean (1 is perfect).\n\n" + _md_table(
        ["matrix", "parts", "nnz", "imbalance A", "imbalance A^T blocks", "min nnz/part", "max nnz/part"], body)


def csv_section(paths: Iterable[Any], title: str) -> str:
    """Markdown: CSV tables rendered as they are (e.g. the SpMV benchmark)."""
    out = []
    for path in paths:
        p = Path(path)
        try:
            with open(p, encoding="utf-8", newline="") as fh:
                recs = list(csv.reader(fh))
        except OSError as exc:
            raise InputError(p, f"cannot read CSV ({exc})") from None
        if not recs:
            continue
        out.append(f"\n### {p}\n\n" + _md_table(recs[0], recs[1:]))
    return f"## {title}\n" + "".join(out) if out else ""


# --------------------------------------------------------------------------- plots
def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", str(text)).strip("_") or "x"


#: What the parts of a configuration's label mean (see :func:`config_label`), printed under the plots.
LABEL_KEY = (
    "Labels: backend (cpu, cuda) and fp/bp, the forward- and back-projection kernels (e.g. cpu: numba, scipy; "
    "cuda: csr_vector, merge, cusparse); +AT: the back projection reads a stored transpose A^T; "
    "notrans: it scatters with A, no transpose; xP: on P GPUs, with the multi-GPU layout (local: one "
    "all-reduce of the image per iteration; thesis: one after each projection); secN: merge section size; "
    "graph: iterations replayed as CUDA graphs; reference (float64): the CPU reference MLEM."
)


def _plot_labels(groups: Mapping[tuple, list[dict[str, Any]]]) -> tuple[list[str], str]:
    """Axis labels of the configurations, and the problem they share (for the title; "" if several)."""
    problems = [f"{rs[0]['matrix']} / {rs[0]['data']}" for rs in groups.values()]
    labels = [config_label(rs[0]) for rs in groups.values()]
    if len(set(problems)) == 1:
        return labels, problems[0]
    return [f"{p}\n{label}" for p, label in zip(problems, labels)], ""


def _add_key(fig: Any, text: str, width: int = 130) -> None:
    """Lay the figure out, then put a wrapped explanatory note under it (kept by :func:`_save`)."""
    import textwrap

    if fig.get_layout_engine() is None:  # not laid out by constrained layout
        fig.tight_layout()
    fig.text(0.01, -0.01, textwrap.fill(text, width), fontsize=7, va="top", ha="left", color="0.25")


def _save(fig: Any, path: Path, dpi: int = 110) -> None:
    """Write the figure with everything drawn outside the axes (legend, note) and close it."""
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=dpi, bbox_inches="tight", pad_inches=0.15)
    plt.close(fig)


def _sci(value: float, _pos: Any = None) -> str:
    """Tick label in compact scientific notation (``-6e-9``, ``0``)."""
    if value == 0:
        return "0"
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def plot_times(groups: Mapping[tuple, list[dict[str, Any]]], path: Path) -> None:
    """Stacked bars of the mean step times per configuration, a circle per repetition's mean.

    The legend sits outside the axes (it hides no point) and a key under the
    plot says what the configuration labels mean.
    """
    import matplotlib.pyplot as plt

    labels, problem = _plot_labels(groups)
    fig, ax = plt.subplots(figsize=(9, 1.0 + 0.5 * max(1, len(labels))))
    y = np.arange(len(labels))
    left = np.zeros(len(labels))
    colors = {"fp": "tab:blue", "corr": "tab:orange", "bp": "tab:green", "update": "tab:red", "allreduce": "tab:purple"}
    names = {"fp": "fp: forward projection A f", "corr": "corr: g / (A f)", "bp": "bp: back projection A^T c",
             "update": "update: f * bp / norm", "allreduce": "allreduce: between GPUs"}
    for s in STEPS:
        vals = np.array([(_mean(r[f"{s}_mean_s"] for r in rs) or 0.0) * 1e3 for rs in groups.values()])
        if vals.any():
            ax.barh(y, vals, left=left, color=colors[s], label=names[s], height=0.6)
            left += vals
    for k, rs in enumerate(groups.values()):
        pts = [r["iteration_mean_s"] * 1e3 for r in rs if r["iteration_mean_s"] is not None]
        ax.plot(pts, [k] * len(pts), "o", color="black", mfc="white", ms=5, zorder=3,
                label="one repetition's mean time per iteration" if k == 0 else None)
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(left=0)
    ax.set_xlabel("time per iteration (ms): bars, the mean of each step over all iterations and repetitions")
    ax.set_title("MLEM time per iteration by configuration" + (f": {problem}" if problem else ""))
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    _add_key(fig, LABEL_KEY)
    _save(fig, path)


def _whiskers(vals: np.ndarray) -> tuple[float, float]:
    """The ends of a box plot's whiskers (1.5 IQR beyond the quartiles, clipped to the data)."""
    q1, q3 = np.percentile(vals, [25, 75])
    iqr = q3 - q1
    inside = vals[(vals >= q1 - 1.5 * iqr) & (vals <= q3 + 1.5 * iqr)]
    return float(inside.min()), float(inside.max())


def distribution_limits(data: list[list[float]]) -> tuple[float, float, bool]:
    """x range of the distribution plot: every box and whisker, not the far outliers.

    Returns ``(low, high, log)``: the span of the whiskers, stretched to
    outliers no further than half that span beyond them, with a margin; and
    whether a logarithmic axis is needed (boxes more than 20x apart).
    Outliers beyond the range are marked at its edge.
    """
    ends = [_whiskers(np.asarray(v, dtype=np.float64)) for v in data]
    lo, hi = min(e[0] for e in ends), max(e[1] for e in ends)
    if lo > 0 and hi / lo > 20:
        return lo / 1.3, hi * 1.3, True
    reach = 0.5 * (hi - lo)
    values = np.concatenate([np.asarray(v, dtype=np.float64) for v in data])
    lo = float(values[values >= lo - reach].min())
    hi = float(values[values <= hi + reach].max())
    pad = 0.05 * (hi - lo) or 0.05 * abs(hi) or 1.0
    return max(lo - pad, 0.0), hi + pad, False


def plot_distribution(groups: Mapping[tuple, list[dict[str, Any]]], path: Path) -> None:
    """Box plot of every iteration's time by configuration.

    The axis spans the boxes and whiskers; outliers within it are drawn as
    circles, those beyond it as a triangle at the edge with their times, so
    that one slow iteration does not squeeze every box.
    """
    import matplotlib.pyplot as plt

    data, labels = [], []
    shown = OrderedDict((k, rs) for k, rs in groups.items() if any(
        v is not None for r in rs for v in (r.get("_samples") or {}).get("iteration", [])))
    if shown:
        labels, problem = _plot_labels(shown)
    else:
        problem = ""
    for rs in shown.values():
        data.append([float(v) * 1e3 for r in rs for v in (r.get("_samples") or {}).get("iteration", []) if v is not None])
    fig, ax = plt.subplots(figsize=(9, 1.0 + 0.5 * max(1, len(labels))))
    if data:
        kw = {"orientation": "horizontal"} if _mpl_version() >= (3, 10) else {"vert": False}
        kw["tick_labels" if _mpl_version() >= (3, 9) else "labels"] = labels
        ax.boxplot(data, widths=0.5, flierprops={"marker": "o", "ms": 4, "mfc": "none", "mec": "0.3"}, **kw)
        lo, hi, log = distribution_limits(data)
        if log:
            ax.set_xscale("log")
        ax.set_xlim(lo, hi)
        for k, vals in enumerate(data, start=1):
            far = sorted(v for v in vals if v > hi)
            near = sorted(v for v in vals if v < lo)
            if far:
                ax.plot([hi], [k], ">", color="tab:red", ms=7, clip_on=False, zorder=3)
                ax.annotate(_beyond(far), (hi, k), xytext=(-8, 7), textcoords="offset points", ha="right",
                            fontsize=7, color="tab:red")
            if near:
                ax.plot([lo], [k], "<", color="tab:red", ms=7, clip_on=False, zorder=3)
                ax.annotate(_beyond(near), (lo, k), xytext=(8, 7), textcoords="offset points", ha="left",
                            fontsize=7, color="tab:red")
        ax.invert_yaxis()
        ax.tick_params(axis="y", labelsize=8)
        ax.grid(axis="x", alpha=0.3)
        ax.set_xlabel("time per iteration (ms), every iteration of every repetition" + (" (log scale)" if log else ""))
    else:
        ax.text(0.5, 0.5, "no per-iteration samples", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel("time per iteration (ms)")
    ax.set_title("Distribution of the time per iteration" + (f": {problem}" if problem else ""))
    _add_key(fig, "Boxes: median and quartiles; whiskers: the furthest iteration within 1.5 times the box's "
                  "width; circles: iterations beyond the whiskers; a red triangle at the edge: iterations beyond "
                  "the plotted range, with their times. " + LABEL_KEY)
    _save(fig, path)


def _beyond(vals: list[float]) -> str:
    """Label of outliers beyond the plotted range: their count and times (ms)."""
    shown = ", ".join(f"{v:.4g}" for v in (vals if len(vals) <= 3 else [vals[0], vals[-1]]))
    if len(vals) > 3:
        shown = shown.replace(", ", " … ")
    return f"{len(vals)} beyond: {shown} ms"


def _mpl_version() -> tuple[int, int]:
    import matplotlib

    major, minor = (int(re.match(r"\d+", x).group()) for x in matplotlib.__version__.split(".")[:2])
    return major, minor


def accuracy_baselines(rows: Iterable[Mapping[str, Any]]) -> dict[tuple, tuple[float, str]]:
    """Per problem ``(matrix, data)``: the image sum the others are compared with, and what it is.

    The float64 reference's sum where known (a run's ``reference_sum``, or
    the reference's own image sum), else the mean image sum of the problem's
    runs.
    """
    out: dict[tuple, tuple[float, str]] = {}
    by_problem: OrderedDict[tuple, list[Mapping[str, Any]]] = OrderedDict()
    for r in rows:
        by_problem.setdefault((r.get("matrix"), r.get("data")), []).append(r)
    for problem, rs in by_problem.items():
        refs = [_num(r.get("reference_sum")) for r in rs if _num(r.get("reference_sum")) is not None]
        refs += [_num(r.get("image_sum")) for r in rs if r.get("reference_mode") and _num(r.get("image_sum")) is not None]
        if refs:
            out[problem] = (refs[0], "reference")
            continue
        sums = [_num(r.get("image_sum")) for r in rs if _num(r.get("image_sum")) is not None]
        if sums:
            out[problem] = (float(np.mean(sums)), "mean")
    return out


def plot_accuracy(groups: Mapping[tuple, list[dict[str, Any]]], path: Path) -> None:
    """Image sum (relative to the reference's) and relative L2 error to the reference, per repetition.

    The left panel shows ``(S - S_ref) / S_ref``, so that a spread of a few
    float32 roundings reads as what it is (1e-8 of the sum), not as the
    absolute sums' last digits.
    """
    import matplotlib.pyplot as plt

    labels, problem = _plot_labels(groups)
    base = accuracy_baselines(r for rs in groups.values() for r in rs)
    kinds = {kind for _, kind in base.values()}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 1.4 + 0.5 * max(1, len(labels))), sharey=True)
    diffs: list[float] = []
    for k, rs in enumerate(groups.values()):
        ref = base.get((rs[0]["matrix"], rs[0]["data"]))
        sums = [r["image_sum"] for r in rs if r["image_sum"] is not None]
        if ref and ref[0]:
            d = [(s - ref[0]) / ref[0] for s in sums]
            diffs += d
            ax1.plot(d, [k] * len(d), "o", mfc="none", color="tab:blue", ms=6)
        rel = [r["rel_l2_reference"] for r in rs if r["rel_l2_reference"] is not None]
        pos = [v for v in rel if v > 0]
        ax2.plot(pos, [k] * len(pos), "o", mfc="none", color="tab:red", ms=6)
        note = "the reference itself" if rs[0].get("reference_mode") else (
            "0: identical to the reference" if rel and not pos else ("no reference" if not rel else ""))
        if note:
            ax2.annotate(note, (0.02, k), xycoords=("axes fraction", "data"), va="center", fontsize=7, color="0.35")
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    ax1.axvline(0.0, color="0.4", lw=1, ls=":")
    width = max((abs(d) for d in diffs), default=0.0)
    width = width * 1.3 if width > 0 else 1e-7
    ax1.set_xlim(-width, width)
    ax1.xaxis.set_major_locator(MaxNLocator(7, symmetric=True))
    ax1.xaxis.set_major_formatter(FuncFormatter(_sci))
    ax1.tick_params(axis="x", labelsize=7)
    ax1.set_yticks(np.arange(len(labels)), labels, fontsize=8)
    ax1.invert_yaxis()
    against = "the float64 reference's" if kinds == {"reference"} else (
        "the mean of the problem's runs" if kinds == {"mean"} else "the reference's (else the runs' mean)")
    ax1.set_xlabel(f"image sum relative to {against}: (S - S_ref) / S_ref\n(0, dotted: equal; float32 rounding "
                   "is about 1e-7)", fontsize=8)
    ax1.set_title("image sum, per repetition", fontsize=9)
    ax2.set_xlabel("relative L2 error to the float64 reference:\n||f - f_ref|| / ||f_ref|| (log scale)", fontsize=8)
    ax2.set_title("image, per repetition", fontsize=9)
    errors = [v for line in ax2.get_lines() for v in line.get_xdata()]
    if errors:
        ax2.set_xscale("log")
        # Whole decades, so that the ticks are labelled powers of ten.
        lo, hi = math.floor(math.log10(min(errors)) - 0.1), math.ceil(math.log10(max(errors)) + 0.1)
        ax2.set_xlim(10.0**lo, 10.0 ** max(hi, lo + 1))
    else:
        ax2.set_xticks([])
    for ax in (ax1, ax2):
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle("Accuracy over repetitions" + (f": {problem}" if problem else ""))
    _add_key(fig, LABEL_KEY, width=160)
    _save(fig, path)


def scaling_series(rows: Iterable[Mapping[str, Any]]) -> OrderedDict[tuple[str, str], list[tuple[int, float]]]:
    """Speed-up against the GPU count, per configuration and layout (the lines of ``plots/scaling.png``).

    Keys are ``("{matrix}/{data} {configuration}", layout)``, values ``(P,
    speed-up)`` points. Each line starts at its configuration's 1-GPU run
    (speed-up 1) and holds the runs of one layout on more GPUs;
    configurations without a 1-GPU run have no speed-up and no line.
    """
    recs = [r for r in scaling_table(rows) if r["speedup"] is not None]
    lines: OrderedDict[tuple[str, str], list[tuple[int, float]]] = OrderedDict()
    for r in recs:
        if r["gpus"] == 1:
            continue
        name = (f"{r['matrix']}/{r['data']} {r['configuration']}", r["layout"])
        if name not in lines:
            conf = (r["matrix"], r["data"], r["configuration"])
            ones = [x for x in recs if (x["matrix"], x["data"], x["configuration"]) == conf and x["gpus"] == 1]
            one = next((x for x in ones if x["layout"] == r["layout"]), None) or next(
                (x for x in ones if x["layout"] == "local"), ones[0] if ones else None)
            lines[name] = [(1, one["speedup"])] if one else []
        lines[name].append((r["gpus"], r["speedup"]))
    return lines


def plot_scaling(rows: Iterable[Mapping[str, Any]], path: Path) -> bool:
    """Speed-up against GPUs, one line per configuration and layout, and y = P. False (nothing written) if no line."""
    import matplotlib.pyplot as plt

    lines = scaling_series(rows)
    if not lines:
        return False
    counts = sorted({p for pts in lines.values() for p, _ in pts})
    fig, ax = plt.subplots(figsize=(7.5, 5))
    ax.plot(counts, counts, color="0.6", ls=":", label="ideal (speed-up = P)")
    colors: dict[str, str] = {}  # one colour per configuration, one line style per layout
    for (conf, layout), pts in lines.items():
        color = colors.setdefault(conf, f"C{len(colors) % 10}")
        ax.plot([p for p, _ in pts], [s for _, s in pts], marker="o", color=color,
                ls="--" if layout == "thesis" else "-", label=f"{conf} {layout}")
    ax.set_xticks(counts, [str(p) for p in counts])
    ax.set_xlabel("GPUs (P)")
    ax.set_ylabel("speed-up T(1) / T(P)")
    ax.set_title("MLEM scaling over GPUs (mean time per iteration)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def time_vs_gpus_series(rows: Iterable[Mapping[str, Any]]) -> OrderedDict[tuple[str, str], dict[int, list[float]]]:
    """Time per iteration (s) against the GPU count, per configuration and layout (``plots/time_vs_gpus.png``).

    Keys are ``("{matrix}/{data} {configuration}", layout)`` as in
    :func:`scaling_series`; values map a GPU count to each repetition's
    ``iteration_mean_s``. A configuration's 1-GPU runs start each of its
    layouts' lines (one GPU has no layout); cuda runs only, the reference left
    out.
    """
    cells: OrderedDict[tuple[str, int, str], list[float]] = OrderedDict()
    for r in rows:
        if r.get("reference_mode") or _family(r.get("backend")) != "cuda" or r.get("iteration_mean_s") is None:
            continue
        conf = f"{r['matrix']}/{r['data']} {_scaling_label(r)}"
        p = int(_num(r.get("gpus")) or 1)
        layout = "local" if p == 1 else str(r.get("layout"))
        cells.setdefault((conf, p, layout), []).append(float(r["iteration_mean_s"]))
    lines: OrderedDict[tuple[str, str], dict[int, list[float]]] = OrderedDict()
    for conf in dict.fromkeys(c for c, _, _ in cells):
        layouts = list(dict.fromkeys(lay for c, p, lay in cells if c == conf and p > 1)) or ["local"]
        for layout in layouts:
            pts = {p: v for (c, p, lay), v in cells.items() if c == conf and (lay == layout or p == 1)}
            lines[(conf, layout)] = dict(sorted(pts.items()))
    return lines


def plot_time_vs_gpus(rows: list[dict[str, Any]], path: Path) -> bool:
    """Time per iteration (ms) against GPUs: a line per configuration and layout, the thesis's run where it fits.

    The line joins the means over repetitions; each repetition's mean is a
    small circle. Where a run's matrix has the shape of a thesis matrix, the
    thesis's time per iteration on its GPUs is a star. The y axis is
    logarithmic where the times span more than a factor of 20. False (nothing
    written) without a cuda run.
    """
    import matplotlib.pyplot as plt

    from mlemlib import thesis

    lines = time_vs_gpus_series(rows)
    if not lines:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    colors: dict[str, str] = {}
    times: list[float] = []
    counts: set[int] = set()
    for (conf, layout), pts in lines.items():
        color = colors.setdefault(conf, f"C{len(colors) % 10}")
        xs = list(pts)
        means = [float(np.mean(v)) * 1e3 for v in pts.values()]
        ax.plot(xs, means, marker="s", ms=5, color=color, ls="--" if layout == "thesis" else "-",
                label=f"{conf} {layout}")
        for p, v in pts.items():
            ax.plot([p] * len(v), [x * 1e3 for x in v], "o", ms=4, mfc="none", color=color, alpha=0.8)
            times += [x * 1e3 for x in v]
        counts.update(xs)
    shapes = {r.get("_shape") for r in rows if r.get("_shape")}
    for run in thesis.RUNS:
        if run.matrix.shape in shapes:
            t = run.iteration_s * 1e3
            ax.plot([run.gpus], [t], "*", ms=14, color="black", zorder=4,
                    label=f"thesis {run.table}: {run.matrix.name}, {run.gpus}x {run.gpu.model} ({run.platform})")
            ax.annotate(f"thesis: {t:.4g} ms", (run.gpus, t), xytext=(-10, -3), textcoords="offset points",
                        fontsize=7, ha="right")
            times.append(t)
            counts.add(run.gpus)
    if times and min(times) > 0 and max(times) / min(times) > 20:
        ax.set_yscale("log")
        ax.set_ylabel("time per iteration (ms, log scale)")
    else:
        ax.set_ylim(bottom=0, top=max(times) * 1.1 if times else None)
        ax.set_ylabel("time per iteration (ms)")
    ax.set_xticks(sorted(counts), [str(p) for p in sorted(counts)])
    ax.set_xlim(0.5, max(counts) + 0.5)
    ax.set_xlabel("GPUs (P)")
    ax.set_title("MLEM time per iteration against the number of GPUs")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    _add_key(fig, "Squares joined by a line: the mean over repetitions of each configuration and layout (dashed: "
                  "the thesis layout); circles: each repetition's mean time per iteration; a star: the thesis's "
                  "run on a matrix of the same shape (the sum of its published step times). " + LABEL_KEY, width=110)
    _save(fig, path)
    return True


#: Colour-bar label of the image plots: what a voxel value measures.
IMAGE_UNITS = "activity per voxel (A f = expected counts per LOR)"

#: The note under the image plots.
IMAGE_NOTE = (
    "Central slices through the field of view, centred on 0. A voxel's value is the activity MLEM estimates, in "
    "the units A gives it: A f is the expected number of counts of each LOR (for the scanner presets, whose "
    "elements are chord lengths in mm, counts per mm of chord). Truth and reconstruction share one grey scale, "
    "from 0 to the 99.9th percentile of both (the arrow: brighter voxels)."
)


def _axis_mm(count: int, size: float) -> tuple[float, float]:
    """Extent (mm) of ``count`` voxels of ``size`` mm, centred on 0 (as the phantoms are)."""
    return -count * size / 2.0, count * size / 2.0


def _centre_mm(count: int, size: float) -> float:
    """Position (mm) of the centre of the central voxel ``count // 2``."""
    return (count // 2 + 0.5 - count / 2.0) * size


def plot_image(image_path: Any, truth_path: Any, path: Path, title: str) -> bool:
    """Central axial, coronal and sagittal slices of an image (and of the truth above it). False if unreadable.

    Axes in mm (the field of view centred on 0; in voxels where the image
    has no voxel size), one colour scale shared by truth and reconstruction
    (0 to the 99.9th percentile of both) and one colour bar with the units.
    """
    import matplotlib.pyplot as plt

    from mlemlib.image import read_image

    try:
        img, attrs = read_image(image_path)
    except InputError as exc:
        log.warning("no image plot: %s", exc)
        return False
    grid = attrs.get("grid")
    if not grid:
        log.warning("%s: no grid attribute; no slice plot", image_path)
        return False
    gx, gy, gz = (int(v) for v in grid)
    vols = []
    if truth_path:
        try:
            t, _ = read_image(truth_path, expected_length=img.size)
            vols.append(("truth", t.reshape(gz, gy, gx)))
        except InputError as exc:
            log.warning("truth not shown: %s", exc)
    vols.append(("reconstruction", img.reshape(gz, gy, gx)))
    voxel = attrs.get("voxel_size")
    unit = "mm" if voxel else "voxels"
    vx, vy, vz = (float(v) for v in voxel) if voxel else (1.0, 1.0, 1.0)
    ex, ey, ez = _axis_mm(gx, vx), _axis_mm(gy, vy), _axis_mm(gz, vz)
    vmax = max(float(np.percentile(v, 99.9)) for _, v in vols) or max(float(v.max()) for _, v in vols) or 1.0
    # Columns as wide as their slices: axial x by y, coronal x by z, sagittal y by z.
    widths = [gx * vx, gx * vx, gy * vy]
    fig, axes = plt.subplots(len(vols), 3, figsize=(11, 0.6 + 3.2 * len(vols)), squeeze=False,
                             gridspec_kw={"width_ratios": widths}, constrained_layout=True)
    for row, (name, v) in enumerate(vols):
        slices = [
            (f"axial, z = {_centre_mm(gz, vz):g} {unit}", v[gz // 2], (*ex, *ey), "x", "y"),
            (f"coronal, y = {_centre_mm(gy, vy):g} {unit}", v[:, gy // 2, :], (*ex, *ez), "x", "z"),
            (f"sagittal, x = {_centre_mm(gx, vx):g} {unit}", v[:, :, gx // 2], (*ey, *ez), "y", "z"),
        ]
        for col, (sname, sl, extent, xl, yl) in enumerate(slices):
            ax = axes[row][col]
            im = ax.imshow(sl, cmap="gray", vmin=0, vmax=vmax, origin="lower", extent=extent,
                           interpolation="nearest")
            ax.set_title(f"{name}: {sname}", fontsize=8)
            ax.set_xlabel(f"{xl} ({unit})", fontsize=7)
            ax.set_ylabel(f"{yl} ({unit})", fontsize=7)
            ax.tick_params(labelsize=7)
    bar = fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.85, extend="max", aspect=30)
    bar.set_label(IMAGE_UNITS, fontsize=8)
    bar.ax.tick_params(labelsize=7)
    fig.suptitle(title, fontsize=9)
    _add_key(fig, IMAGE_NOTE, width=150)
    _save(fig, path, dpi=100)
    return True


# --------------------------------------------------------------------------- HTML
# The Snakemake report shows HTML files (in a frame) and images; a CSV or
# Markdown result is only offered as a link that browsers open blank. So the
# tables go into the report as HTML: summary.html (summary.md rendered) and
# runs.html (runs.csv as a table).
_HTML_STYLE = (
    "body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;font-size:13px;margin:1em 1.5em;color:#222}"
    "h1{font-size:1.5em}h2{font-size:1.25em;margin-top:1.6em;border-bottom:1px solid #ddd}h3{font-size:1.05em}"
    "p{max-width:75em;line-height:1.4}table{border-collapse:collapse;margin:.5em 0 1.2em}"
    "th,td{border:1px solid #ccc;padding:2px 7px;text-align:right;white-space:nowrap}"
    "th{background:#f2f2f2;position:sticky;top:0}td.t{text-align:left}"
    "code{background:#f4f4f4;padding:0 2px}.wide{overflow-x:auto}"
)


def _html_page(title: str, body: str) -> str:
    from html import escape

    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{escape(title)}</title>"
            f"<style>{_HTML_STYLE}</style></head><body>\n{body}</body></html>\n")


def _inline_html(text: str) -> str:
    """Escape text and render the inline Markdown the summary uses: `code`, **bold**, *italic*."""
    from html import escape

    parts = re.split(r"(`[^`]*`)", text)
    out = []
    for part in parts:
        if len(part) >= 2 and part.startswith("`") and part.endswith("`"):
            out.append(f"<code>{escape(part[1:-1])}</code>")
            continue
        s = escape(part, quote=False)
        s = re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", s)
        s = re.sub(r"(?<![\w*])\*([^*\s][^*]*)\*(?![\w*])", r"<em>\1</em>", s)
        out.append(s)
    return "".join(out)


def _table_cells(line: str) -> list[str]:
    """Cells of a Markdown table row as :func:`_md_table` writes it (``\\|`` is a literal bar)."""
    inner = line.strip()[1:]
    if inner.endswith("|") and not inner.endswith("\\|"):
        inner = inner[:-1]
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", inner)]


def _numeric(cell: str) -> bool:
    return bool(re.fullmatch(r"[-+]?[\d.,]+(e[-+]?\d+)?( ?(s|ms|us|ns|x|%))?|–|", cell.strip()))


def markdown_to_html(text: str, title: str) -> str:
    """An HTML page of the Markdown the summary writes (headings, paragraphs, lists, pipe tables).

    Not a general Markdown renderer: it knows the constructs of
    :func:`summarize`'s sections, and escapes everything else.
    """
    out: list[str] = []
    para: list[str] = []
    items: list[str] = []
    table: list[list[str]] = []

    def flush() -> None:
        if para:
            out.append(f"<p>{_inline_html(' '.join(para))}</p>")
            para.clear()
        if items:
            out.append("<ul>" + "".join(f"<li>{_inline_html(i)}</li>" for i in items) + "</ul>")
            items.clear()
        if table:
            head, rows = table[0], [r for r in table[1:] if not all(re.fullmatch(r":?-{3,}:?", c) for c in r)]
            cells = "".join(f"<th>{_inline_html(h)}</th>" for h in head)
            html_rows = [f"<tr>{cells}</tr>"]
            for r in rows:
                html_rows.append("<tr>" + "".join(
                    f"<td>{_inline_html(c)}</td>" if _numeric(c) else f"<td class=\"t\">{_inline_html(c)}</td>"
                    for c in r) + "</tr>")
            out.append("<div class=\"wide\"><table>" + "".join(html_rows) + "</table></div>")
            table.clear()

    for line in text.splitlines():
        stripped = line.strip()
        heading = re.match(r"(#{1,6})\s+(.*)", stripped)
        if not stripped:
            flush()
        elif heading:
            flush()
            level = len(heading.group(1))
            out.append(f"<h{level}>{_inline_html(heading.group(2))}</h{level}>")
        elif stripped.startswith("|"):
            if para or items:
                flush()
            table.append(_table_cells(stripped))
        elif stripped.startswith("- "):
            if para or table:
                flush()
            items.append(stripped[2:])
        else:
            if table or items:
                flush()
            para.append(stripped)
    flush()
    return _html_page(title, "\n".join(out) + "\n")


def runs_html(rows: list[dict[str, Any]], csv_name: str, title: str) -> str:
    """An HTML page of ``runs.csv``: one row per run and repetition, numbers to 6 significant digits."""
    from html import escape

    cols = _columns(rows)

    def cell(v: Any) -> str:
        if v is None or v == "":
            return "<td></td>"
        if isinstance(v, float):
            return f"<td>{v:.6g}</td>"
        if isinstance(v, (int, bool)):
            return f"<td>{v}</td>"
        return f"<td class=\"t\">{escape(str(v))}</td>"

    head = "".join(f"<th>{escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(cell(r.get(c)) for c in cols) + "</tr>" for r in rows)
    intro = (f"<h1>{escape(title)}</h1><p>One row per run and repetition ({len(rows)} rows): the configuration, "
             "times per iteration and per step in seconds, bandwidths in GB/s, the image sum and its errors. "
             f"Numbers are shown to 6 significant digits; <code>{escape(csv_name)}</code> beside this file has "
             "them in full. docs/reconstruction.md describes every column.</p>")
    return _html_page(title, f"{intro}<div class=\"wide\"><table><tr>{head}</tr>{body}</table></div>\n")


# --------------------------------------------------------------------------- summary
def summarize(
    runs: Iterable[Any] = (),
    out_dir: str | os.PathLike | None = None,
    *,
    transpose_benchmarks: Iterable[Any] = (),
    timings: Iterable[Any] = (),
    references: Iterable[Any] = (),
    exact_references: Iterable[Any] = (),
    plans: Iterable[Any] = (),
    transposes: Iterable[Any] = (),
    bench: Iterable[Any] = (),
    out_csv: str | os.PathLike | None = None,
    out_md: str | os.PathLike | None = None,
    out_plots: str | os.PathLike | None = None,
    out_html: str | os.PathLike | None = None,
    out_runs_html: str | os.PathLike | None = None,
    name: str | None = None,
) -> dict[str, Any]:
    """Write ``runs.csv``, ``summary.md``, ``summary.html``, ``runs.html`` and ``plots/`` for a set of runs.

    Parameters
    ----------
    runs, timings
        Run directories, ``timings.json`` files or timings dicts (both lists are used).
    out_dir
        Where ``runs.csv``, ``summary.md``, ``summary.html``, ``runs.html`` and
        ``plots/`` go (individual paths ``out_csv``, ``out_md``,
        ``out_html``, ``out_runs_html``, ``out_plots`` take precedence).
    transpose_benchmarks
        Snakemake benchmark ``.tsv`` files of the transposition jobs.
    references
        ``timings.json`` of the float64 references (``.h5`` files are ignored).
    exact_references
        ``results/{matrix}/runs/{data}/reference-exact/image.h5``: the float64
        reference on the lossless source of a lossy-format matrix
        (:func:`lossy_section`).
    plans
        ``plan.json`` files (or their directories) of the partitions.
    transposes
        ``transpose.h5`` files (their ``method``/``seconds`` attributes).
    bench
        SpMV benchmark CSV tables, rendered as they are.
    name
        Name of the configuration (the workflow's ``name``), shown in the titles.

    Returns
    -------
    dict
        ``rows`` (number of rows), ``configurations``, and the written paths
        (``runs_csv``, ``summary_md``, ``summary_html``, ``runs_html``,
        ``plots``: list of PNG paths).

    Raises
    ------
    InputError
        An input that is missing or not what it should be.
    """
    if out_dir is None and None in (out_csv, out_md, out_plots, out_html, out_runs_html):
        raise InputError("out", "give out_dir, or all of out_csv, out_md, out_html, out_runs_html and out_plots")
    out = Path(out_dir) if out_dir is not None else None
    csv_path = Path(out_csv) if out_csv is not None else out / "runs.csv"
    md_path = Path(out_md) if out_md is not None else out / "summary.md"
    html_path = Path(out_html) if out_html is not None else out / "summary.html"
    runs_html_path = Path(out_runs_html) if out_runs_html is not None else out / "runs.html"
    plots_dir = Path(out_plots) if out_plots is not None else out / "plots"
    title = "MLEM runs: summary" + (f" of configuration {name}" if name else "")

    refs = [r for r in references if not os.fspath(r).endswith((".h5", ".hdf5"))]
    loaded = load_timings([*runs, *timings, *refs])
    rows = run_rows(loaded)
    groups = group_rows(rows)
    trows = transpose_rows(transposes, transpose_benchmarks)
    log.info("summarising %d runs (%d rows, %d configurations)", len(loaded), len(rows), len(groups))

    write_runs_csv(rows, csv_path)

    plot_names: list[str] = []
    import matplotlib

    matplotlib.use("Agg")
    with atomic_dir(plots_dir) as tmp:
        if groups:
            plot_times(groups, tmp / "time_per_iteration.png")
            plot_distribution(groups, tmp / "time_distribution.png")
            plot_accuracy(groups, tmp / "accuracy.png")
            plot_names += ["time_per_iteration.png", "time_distribution.png", "accuracy.png"]
            if plot_scaling(rows, tmp / "scaling.png"):
                plot_names.append("scaling.png")
            if plot_time_vs_gpus(rows, tmp / "time_vs_gpus.png"):
                plot_names.append("time_vs_gpus.png")
        seen: set[tuple] = set()
        for r in sorted(rows, key=lambda r: (bool(r["reference_mode"]), r["run"])):
            problem = (r["matrix"], r["data"])
            image = run_image(r)
            if problem in seen or image is None:
                continue
            name = f"image_{_slug(r['matrix'])}_{_slug(r['data'])}.png"
            if plot_image(image, r.get("_truth"), tmp / name, f"{r['matrix']} / {r['data']}: {config_label(r)} ({r['run']})"):
                seen.add(problem)
                plot_names.append(name)

    sections = [
        timing_section(groups) if groups else "No runs.\n",
        scaling_section(rows),
        thesis_section(rows),
        accuracy_section(groups) if groups else "",
        lossy_section(rows, exact_references),
        transpose_section(trows),
        plan_section(plans),
        csv_section(bench, "SpMV benchmark"),
        "## Plots\n\n" + ("".join(f"- `{plots_dir.name}/{p}`\n" for p in plot_names) or "none\n"),
    ]
    head = (
        f"# {title}\n\n"
        f"{len(loaded)} runs, {len(rows)} repetitions, {len(groups)} configurations. "
        f"Every row of `{csv_path.name}` is one repetition of one run.\n\n"
    )
    text = head + "\n".join(sec for sec in sections if sec)
    with atomic_path(md_path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    with atomic_path(html_path) as tmp:
        tmp.write_text(markdown_to_html(text, title), encoding="utf-8")
    with atomic_path(runs_html_path) as tmp:
        tmp.write_text(runs_html(rows, csv_path.name, title.replace("summary", "every run and repetition")),
                       encoding="utf-8")
    return {
        "rows": len(rows),
        "configurations": len(groups),
        "runs_csv": os.fspath(csv_path),
        "summary_md": os.fspath(md_path),
        "summary_html": os.fspath(html_path),
        "runs_html": os.fspath(runs_html_path),
        "plots": [os.fspath(plots_dir / p) for p in plot_names],
    }
