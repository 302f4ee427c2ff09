"""The summary's tables: ``runs.csv`` and the Markdown sections of ``summary.md`` (host; pure Python, NumPy).

:func:`write_runs_csv` writes one row per run and repetition in full
precision. Each ``*_section`` function returns one Markdown section (a
heading, a sentence on what its columns measure, a pipe table; "" where it
has nothing to show): time per iteration by step, scaling over GPUs, the
thesis beside us, accuracy over repetitions, MAP (Phi and the time to
threshold), the cost of lossy matrix
values, transposition times, partition balance, the SpMV benchmark and the
plots. Every column that has a unit names it in its header (one unit per
column: MLEM times in ms, whole jobs in s), and numbers are formatted for
reading (times to 3 significant digits, ratios to 2 decimals); numeric
columns are right-aligned.

A wide table comes twice: first its key columns (those that fit a
1400-pixel screen), then, after a paragraph that starts with :data:`MORE`,
in full; the HTML page (:func:`mlemlib.report.html.markdown_page`) folds
everything from that paragraph to the next section behind one click.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from mlemlib._io import atomic_path
from mlemlib.errors import InputError
from mlemlib.metrics import spread
from mlemlib.report.rows import (
    STEPS,
    _family,
    _mean,
    _num,
    config_label,
    exact_reference_problem,
    has_map_metrics,
    label_terms,
    run_columns,
    run_image,
    scaling_table,
    thesis_table,
)
from mlemlib.timing import ordered_steps


def write_runs_csv(rows: list[dict[str, Any]], path: str | os.PathLike) -> None:
    """Write ``runs.csv`` (atomically); floats with full precision, empty cells for missing values."""
    cols = run_columns(rows)
    with atomic_path(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(cols)
        for r in rows:
            w.writerow(["" if r.get(c) is None else (repr(r[c]) if isinstance(r[c], float) else r[c]) for c in cols])



# --------------------------------------------------------------------------- markdown
_NUMERIC = re.compile(r"[-+]?[\d.,]+(e[-+]?\d+)?( ?(s|ms|us|ns|x|%))?|–|-")


def _md_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A pipe table; a column whose cells are all numbers (or empty) is right-aligned."""
    def cell(v: Any) -> str:
        return ("" if v is None else str(v)).replace("|", "\\|").replace("\n", " ")

    cells = [[cell(v) for v in r] for r in rows]
    numeric = [any(k < len(r) and r[k].strip() for r in cells)
               and all(not r[k].strip() or _NUMERIC.fullmatch(r[k].strip()) for r in cells if k < len(r))
               for k in range(len(headers))]
    lines = ["| " + " | ".join(cell(h) for h in headers) + " |",
             "|" + "|".join("---:" if num else "---" for num in numeric) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in cells]
    return "\n".join(lines) + "\n"


def _sig3(v: float) -> str:
    """``v`` to 3 significant digits without an exponent (``1.50``, ``0.0456``, ``123``, ``3590``)."""
    if not math.isfinite(v) or v == 0:
        return f"{v:g}"
    if abs(v) >= 999.5:
        return f"{v:.0f}"
    s = f"{v:#.3g}"
    if "e" in s:  # below 1e-4
        s = f"{v:.{2 - math.floor(math.log10(abs(v)))}f}"
    return s.rstrip(".")


def _fmt_ms(seconds: Any) -> str:
    """Seconds as milliseconds to 3 significant digits (``1.23``, ``0.0456``, ``3600``); the column's header
    says ``(ms)``."""
    v = _num(seconds)
    return _sig3(v * 1e3) if v is not None else ""


def _fmt_3(v: Any) -> str:
    """A number to 3 significant digits, whole above 1000 (``11.8``, ``0.00346``, ``38400``)."""
    v = _num(v)
    return _sig3(v) if v is not None else ""


def _fmt_sec(seconds: Any) -> str:
    """Seconds to 3 significant digits (``0.960``, ``18.3``); the column's header says ``(s)``."""
    v = _num(seconds)
    return _sig3(v) if v is not None else ""


def _fmt_g(v: Any, digits: int = 9) -> str:
    v = _num(v)
    return f"{v:.{digits}g}" if v is not None else ""


def _fmt_pct(v: Any) -> str:
    f = _num(v)
    return "" if f is None else f"{100 * f:.0f}%"


def _fmt_e(v: Any) -> str:
    v = _num(v)
    return f"{v:.3e}" if v is not None else ""


#: After a step time that was measured over iterations launched kernel by kernel (the run replayed CUDA graphs).
KBK_MARK = " †"


def _kbk_cell(r: Mapping[str, Any], cell: str) -> str:
    """A step's cell, marked where the step was timed kernel by kernel after a graph run (an empty one stays empty)."""
    return cell + KBK_MARK if cell and r.get("steps_from") else cell


#: The paragraph that opens the folded part of a section (every column, the details): the HTML page shows
#: what follows it, up to the next section, behind a click (``<details>``); ``summary.md`` shows it all.
MORE = "In full:"


def _more(what: str) -> str:
    """The paragraph that opens a section's folded part, saying what it holds."""
    return f"\n{MORE} {what}.\n\n"


def _problems(groups: Mapping[tuple, list[dict[str, Any]]]) -> list[str]:
    """The problems (``matrix / data``) of the configurations, in first-seen order."""
    return list(dict.fromkeys(f"{rs[0]['matrix']} / {rs[0]['data']}" for rs in groups.values()))


def _is_gpu(r: Mapping[str, Any]) -> bool:
    """Whether a row is a run on GPUs (the float64 reference is not)."""
    return not r.get("reference_mode") and _family(r.get("backend")) == "cuda"


def _energy_cell(rs: list[dict[str, Any]]) -> str:
    """A configuration's energy per iteration in J (mean over repetitions), ``not measured`` for a GPU run
    whose counter gave nothing, ``–`` on the CPU (no counter)."""
    if not _is_gpu(rs[0]):
        return "–"
    v = _mean(r.get("energy_per_iteration_J") for r in rs)
    return _fmt_g(v, 4) if v is not None else "not measured"


def _deterministic_cell(r: Mapping[str, Any]) -> str:
    return "yes" if r.get("deterministic") else "NO (atomics)"


def _model_key(r: Mapping[str, Any]) -> tuple:
    """The problem and model a speed-up compares within: matrix, data, subsets, m and b, and a MAP run's
    algorithm, prior and its parameters."""
    return (r.get("matrix"), r.get("data"), r.get("subsets") or 1, r.get("m"), r.get("b"), r.get("map_algorithm"),
            r.get("prior"), r.get("beta"), r.get("_map_params"))


def speedup_baselines(groups: Mapping[tuple, list[dict[str, Any]]]) -> dict[tuple, tuple[float, str, bool]]:
    """Per problem and model (:func:`_model_key`): the time per iteration speed-ups are measured against, the
    label of its configuration, and whether it is the float64 reference.

    The float64 reference of the same problem and model where it ran (the
    CPU reference MLEM), else the problem's first CPU configuration, else its
    slowest configuration (a summary of GPU runs alone).
    """
    out: dict[tuple, tuple[float, str, bool]] = {}
    for prefer_reference in (True, False):
        for rs in groups.values():
            r0 = rs[0]
            key = _model_key(r0)
            t = _mean(r["iteration_mean_s"] for r in rs)
            if key in out or not t:
                continue
            if (r0.get("reference_mode") if prefer_reference
                    else _family(r0.get("backend")) == "cpu" and not r0.get("reference_mode")):
                out[key] = (t, config_label(r0), prefer_reference)
    slowest: dict[tuple, tuple[float, str, bool]] = {}
    for rs in groups.values():
        key, t = _model_key(rs[0]), _mean(r["iteration_mean_s"] for r in rs)
        if key not in out and t and t > slowest.get(key, (0.0, "", False))[0]:
            slowest[key] = (t, config_label(rs[0]), False)
    return {**out, **slowest}


def overview_section(groups: Mapping[tuple, list[dict[str, Any]]], rows: Iterable[Mapping[str, Any]] = ()) -> str:
    """Markdown: the key numbers of every configuration in one narrow table, with what their labels mean.

    Per configuration: the mean time per iteration, the relative L2 error to
    the float64 reference, whether the kernels are deterministic, the
    speed-up over :func:`speedup_baselines` and, where a configuration ran on
    several GPU counts, the speed-up over its 1-GPU run
    (:func:`mlemlib.report.rows.scaling_table`).
    """
    if not groups:
        return ""
    rows = list(rows) or [r for rs in groups.values() for r in rs]
    problems = _problems(groups)
    base = speedup_baselines(groups)
    over_one = {}
    for rec in scaling_table(rows):
        for run in rec["runs"]:
            over_one[run] = rec["speedup"]
    scaled = any(over_one.get(str(rs[0]["run"])) is not None and (rs[0].get("gpus") or 1) > 1
                 for rs in groups.values())
    refs_only = bool(base) and all(is_ref for _, _, is_ref in base.values())
    head = [*(["matrix / data"] if len(problems) > 1 else []), "configuration", "iteration (ms)", "rel. L2 to ref.",
            "deterministic", "speed-up" + (" vs. reference" if base and refs_only else ""),
            *(["speed-up vs. 1 GPU"] if scaled else [])]
    body = []
    for rs in groups.values():
        r0 = rs[0]
        t = _mean(r["iteration_mean_s"] for r in rs)
        b = base.get(_model_key(r0))
        one = over_one.get(str(r0["run"])) if (r0.get("gpus") or 1) > 1 else None
        body.append([
            *([f"{r0['matrix']} / {r0['data']}"] if len(problems) > 1 else []), config_label(r0), _fmt_ms(t),
            _fmt_e(_mean(r["rel_l2_reference"] for r in rs)) or "–",
            _deterministic_cell(r0), f"{b[0] / t:.2f}x" if b and t else "–",
            *([f"{one:.2f}x" if one is not None else "–"] if scaled else []),
        ])
    if refs_only:
        against = ("speed-up: the float64 reference's time per iteration (CPU, same problem and model) over the "
                   "configuration's.")
    else:
        against = ("speed-up: the time per iteration of " + "; ".join(
            f"{label} for {k[0]} / {k[1]}" for k, (_, label, _) in base.items()) + " over the configuration's.")
    intro = ((f"{problems[0]}: " if len(problems) == 1 else "")
             + "each configuration's mean time per iteration (all iterations and repetitions), its relative L2 "
             "error to the float64 reference of the same algorithm (||f - f_ref|| / ||f_ref||, mean over "
             "repetitions), whether its kernels give the same image every time (NO: floating-point atomics) and its "
             "speed-up (–: nothing to compare with). " + against
             + (" speed-up vs. 1 GPU: T(1) / T(P) of the same configuration (the scaling table below)."
                if scaled else "") + "\n\n")
    terms = label_terms(rows)
    labels = ("Labels: " + "; ".join(terms) + ".\n") if terms else ""
    return "## At a glance\n\n" + intro + _md_table(head, body) + "\n" + labels


def timing_section(groups: Mapping[tuple, list[dict[str, Any]]]) -> str:
    """Markdown: time per iteration by step, one row per configuration, then a thesis-style table each.

    First the key columns (the time per iteration and of each step and, where
    a GPU ran, the energy per iteration), then, folded (:data:`MORE`), every
    column: the ``format`` column gives the matrix format on the device and
    its bytes per non-zero of ``A`` where the backend recorded them;
    ``J/iteration`` (the GPUs' energy per iteration, mean over repetitions)
    appears where a GPU ran or some run measured it, ``not measured`` for a
    GPU run whose counter gave nothing (never 0 J).
    """
    every = [r for rs in groups.values() for r in rs]
    energy = any(_is_gpu(r) or r.get("energy_per_iteration_J") is not None for r in every)
    floors = any(r.get("of_floor") is not None for r in every)
    steps = [s for s in STEPS if any(r.get(f"{s}_mean_s") is not None for r in every)]
    several = len(_problems(groups)) > 1
    head = ["matrix", "data", "configuration", "format (bytes/nnz)", "reps", "iteration (ms)", "min (ms)", "max (ms)",
            *(f"{s} (ms)" for s in steps), "GB/s",
            *(["of floor", "of CSR floor"] if floors else []), *(["J/iteration"] if energy else []),
            "deterministic"]
    key_head = [*(["matrix / data"] if several else []), "configuration", "iteration (ms)",
                *(f"{s} (ms)" for s in steps), *(["J/iteration"] if energy else [])]
    body, key_body = [], []
    for rs in groups.values():
        r0 = rs[0]
        iteration = _fmt_ms(_mean(r["iteration_mean_s"] for r in rs))
        step_cells = [_kbk_cell(r0, _fmt_ms(_mean(r[f"{s}_mean_s"] for r in rs))) for s in steps]
        energy_cells = [_energy_cell(rs)] if energy else []
        key_body.append([*([f"{r0['matrix']} / {r0['data']}"] if several else []), config_label(r0), iteration,
                         *step_cells, *energy_cells])
        body.append(
            [
                r0["matrix"], r0["data"], config_label(r0), _format_cell(r0), len(rs), iteration,
                _fmt_ms(min((r["iteration_min_s"] for r in rs if r["iteration_min_s"] is not None), default=None)),
                _fmt_ms(max((r["iteration_max_s"] for r in rs if r["iteration_max_s"] is not None), default=None)),
                *step_cells,
                _fmt_3(_mean(r["bandwidth_GBps"] for r in rs)),
                *([_fmt_pct(_mean(r.get("of_floor") for r in rs)), _fmt_pct(_mean(r.get("of_csr_floor") for r in rs))]
                  if floors else []),
                *energy_cells,
                _deterministic_cell(r0),
            ]
        )
    named = {"fp": "forward projection", "corr": "the measurement's correction", "bp": "back projection",
             "update": "image update",
             "map": "the prior's gradient and the MAP step (BSREM, OSL)", "allreduce": "all-reduce between GPUs"}
    intro = (
        "Mean over all iterations and repetitions, in ms; "
        + ", ".join(f"{s}: {named[s]}" for s in steps)
        + (" (the steps of an iteration; empty where not timed apart)" if steps else "")
        + "."
        + (" J/iteration: the GPUs' energy per iteration from NVML's counters, mean over repetitions (not "
           "measured: the counter gave nothing, e.g. a loop shorter than its update interval; –: a CPU run)."
           if energy else "")
        + (f" {KBK_MARK.strip()}: the run replayed each iteration as CUDA graphs, which time only the whole "
           "iteration; its steps were timed over a few more iterations launched kernel by kernel after it (they "
           "add up to more than a replayed iteration)."
           if any(r.get("steps_from") for r in every) else "")
        + "\n\n"
    )
    more = (
        "min and max: the fastest and slowest single iteration. "
        "format: the matrix format on the device, with its bytes per non-zero of A in brackets where recorded "
        "(CSR: 8, a 4-byte value and a 4-byte column, plus the row pointer)"
        + ("; folded: the matrix stores each distinct row once (a LOR stored as (i, j) and (j, i) once), the same "
           "image from fewer bytes" if any(r.get("_stored_rows") for r in every) else "")
        + ". GB/s: bytes the iteration reads over its mean time: A and A^T where stored (A twice without it; once "
        "in one pass), in the format on the device."
        + (" of floor: the time those bytes take at the GPUs' copy bandwidth measured in the run, over the "
           "iteration's time (100%: as fast as reading them can be); of CSR floor: the same for the bytes of A and "
           "A^T as CSR, read once each (above 100%: faster than any iteration on the CSR pair can be)."
           if floors else "")
        + "\n\n"
    )
    out = ["## Time per iteration by step\n\n", intro, _md_table(key_head, key_body),
           _more("every column, and each configuration step by step (mean, min, max, median)"), more,
           _md_table(head, body)]
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
                ["step", "avg time per iteration (ms)", "min (ms)", "max (ms)", "median (ms)"],
                [[s[0], _fmt_ms(s[1]), _fmt_ms(s[2]), _fmt_ms(s[3]), _fmt_ms(s[4])] for s in steps_sorted],
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
            cr_rows.append([r0["matrix"], r0["data"], config_label(r0),
                            *(_fmt_g(_mean(r.get(c) for r in rs), 4) for c in cr_labels)])
    several = len(_problems(groups)) > 1
    key = [*([0, 1] if several else []), 2, 3, 9, 12, 13, 14]  # configuration, reps, rel. L2 (mean), truth, ...
    intro = (
        "rel. L2 to ref.: ||f - f_ref|| / ||f_ref|| against the float64 reference of the same problem and "
        "algorithm (mean over repetitions); to truth: the same against the phantom. distinct images: how many different float32 "
        "images the repetitions produced (1: bit-identical).\n\n"
    )
    out = ["## Accuracy over repetitions\n\n", intro,
           _md_table([head[k] for k in key], [[row[k] for k in key] for row in body])]
    if cr_rows:
        drop = 0 if several else 2  # one problem: named above the first table
        out += ["\n### Contrast recovery (mean over repetitions; 1 is perfect)\n\n",
                _md_table(["matrix", "data", "configuration", *(c[3:] for c in cr_labels)][drop:],
                          [row[drop:] for row in cr_rows])]
    out += [_more("every column: the image sum (the thesis's measure, a float64 sum) and the spread of both "
                  "measures over repetitions"), _md_table(head, body)]
    return "".join(out)



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



def _fmt_ratio(v: Any) -> str:
    v = _num(v)
    return f"{v:.2f}" if v is not None else "–"


def _fewer_cell(r: Mapping[str, Any]) -> str:
    """``yes``, or ``NO (P' GPU(s): T ms)`` where fewer GPUs were faster; ``–`` on one GPU."""
    if r["gpus"] <= 1:
        return "–"
    if r.get("slower_than") is None:
        return "yes"
    q, tq = r["slower_than"]
    return f"NO ({q} GPU{'s' if q > 1 else ''}: {_fmt_ms(tq)} ms)"


def scaling_section(rows: Iterable[Mapping[str, Any]]) -> str:
    """Markdown: speed-up, parallel efficiency and bandwidth per GPU over GPU counts and layouts ("" if none)."""
    recs = scaling_table(rows)
    if not recs:
        return ""
    steps = [s for s in STEPS if any(r[f"{s}_s"] is not None for r in recs)]
    head = ["matrix", "data", "configuration", "GPUs", "layout", "reps", "iteration (ms)", *(f"{s} (ms)" for s in steps),
            "speed-up",
            "efficiency", "faster than fewer GPUs", "GB/s per GPU", "rel. L2 to ref.", "deterministic"]
    body = [
        [r["matrix"], r["data"], r["configuration"], r["gpus"], r["layout"], r["reps"], _fmt_ms(r["iteration_s"]),
         *(_kbk_cell(r, _fmt_ms(r[f"{s}_s"])) for s in steps), _fmt_ratio(r["speedup"]), _fmt_ratio(r["efficiency"]),
         _fewer_cell(r), _fmt_3(r["bandwidth_per_gpu_GBps"]), _fmt_e(r["rel_l2_reference"]),
         "yes" if r["deterministic"] else "NO (atomics)"]
        for r in recs
    ]
    intro = (
        "Every cuda configuration run on more than one GPU count, by GPU count P and layout. iteration and steps: "
        "mean time per iteration over all iterations and repetitions, as in the table above (†: steps of a run that "
        "replayed CUDA graphs, timed over iterations launched kernel by kernel after it). speed-up: T(1)/T(P), T(1) the configuration's 1-GPU run (– without one); "
        "efficiency: speed-up / P (1 is perfect). faster than fewer GPUs: NO where fewer GPUs ran the same "
        "configuration faster (the fewest such, with their time). GB/s per GPU: bytes an iteration reads (as in the table above) "
        "/ P / T(P), each GPU reading its nnz-balanced part, about 1/P of them. rel. L2 to ref.: mean "
        "over repetitions.\n\n"
    )
    names = ["configuration", "GPUs", "layout", "iteration (ms)", "speed-up", "efficiency", "rel. L2 to ref.",
             "deterministic"]
    if len({(r["matrix"], r["data"]) for r in recs}) > 1:
        names = ["matrix", "data", *names]
    key = [head.index(n) for n in names]
    return ("## Scaling over GPUs\n\n" + intro + _md_table([head[k] for k in key], [[b[k] for k in key] for b in body])
            + _more("every column: the steps, whether fewer GPUs were faster, the bandwidth per GPU")
            + _md_table(head, body))



def _step_cell(r: Mapping[str, Any], step: str, fused_into: str | None) -> str:
    """A step's mean time; ``fused into <step>`` where the backend timed it inside another; – where not timed."""
    t = r.get(f"{step}_s")
    if t is not None:
        return _kbk_cell(r, _fmt_ms(t))
    if fused_into and r.get(f"{fused_into}_s") is not None:
        return f"fused into {fused_into}"
    return "–"



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
    "where fused; a one-pass iteration has no separate fp (*fused into bp*); †: steps of a run that replayed "
    "CUDA graphs (which time only the whole iteration), timed over iterations launched kernel by kernel after "
    "it; –: not timed. J/iteration: the GPUs' energy per iteration (NVML; not measured: its counter gave nothing).\n\n"
)


def thesis_section(rows: Iterable[Mapping[str, Any]]) -> str:
    """Markdown: the thesis beside us, only where a run's matrix has a thesis matrix's shape ("" otherwise)."""
    from mlemlib import thesis

    recs = thesis_table(rows)
    if not recs:
        return ""
    head = ["configuration", "matrix / data", "reps", "GPUs", "GPU", "GB/s per GPU (theor.)", "GB/s total (theor.)",
            "GB/s total (measured copy)", "iteration (ms)", "fp (ms)", "bp (ms)", "allreduce (ms)", "speed-up over thesis",
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
                _fmt_3(r["theoretical_per_gpu_GBps"]) or "–", _fmt_3(r["theoretical_GBps"]) or "–",
                _fmt_3(r["measured_GBps"]) or "–", _fmt_ms(r["iteration_s"]),
                _step_cell(r, "fp", "bp"), _step_cell(r, "bp", None), _step_cell(r, "allreduce", None),
                _fmt_ratio(r["speedup"]), _fmt_ratio(r["bandwidth_ratio"]), _fmt_ratio(r["kernel_gain"]),
                energy or ("–" if r["thesis"] else "not measured"),
            ])
        if not body:
            continue
        intro = THESIS_INTRO.format(
            table=run.table, iterations=run.iterations, gpus=run.gpus, model=run.gpu.model, platform=run.platform,
            bw=run.gpu.theoretical_bandwidth / 1e9, rows=run.matrix.rows, cols=run.matrix.cols,
            total=run.theoretical_bandwidth / 1e9)
        key = [head.index(n) for n in ("configuration", "GPUs", "iteration (ms)", "speed-up over thesis",
                                          "bandwidth ratio", "kernel gain", "J/iteration")]
        out.append(f"## The thesis beside us: {run.matrix.name} ({run.matrix.table})\n\n" + intro
                   + _md_table([head[k] for k in key], [[b[k] for k in key] for b in body])
                   + _more("every column: the matrix, the GPUs and their bandwidths, the steps")
                   + _md_table(head, body))
    return "\n".join(out)



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
    head = ["matrix", "method", "A^T of the runs", "transposition alone (s)", "threads", "whole job (s)",
            "rest of the job (s)", *(["jobs", "whole job min (s)", "whole job max (s)"] if several else []),
            "job's max RSS (MB)"]
    body = []
    for r in rows:
        rest = (r["job_mean_s"] - r["transpose_s"]
                if r.get("job_mean_s") is not None and r.get("transpose_s") is not None else None)
        spread_cells = [r.get("job_n") or "", _fmt_sec(r.get("job_min_s")), _fmt_sec(r.get("job_max_s"))]
        body.append([r["matrix"], r["method"], "yes" if r["used_by_runs"] else "", _fmt_sec(r.get("transpose_s")),
                     _fmt_g(r.get("threads"), 3), _fmt_sec(r.get("job_mean_s")), _fmt_sec(rest),
                     *(spread_cells if several else []), _fmt_3(r.get("max_rss_MB"))])
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


def spmv_rows(path: str | os.PathLike) -> list[dict[str, str]]:
    """The rows of an SpMV benchmark table (``results/{matrix}/bench/spmv.csv``), as read."""
    p = Path(path)
    try:
        with open(p, encoding="utf-8", newline="") as fh:
            recs = list(csv.DictReader(fh))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise InputError(p, f"cannot read CSV ({exc})") from None
    if recs and not {"op", "kernel", "median_s"} <= set(recs[0]):
        raise InputError(p, "not an SpMV benchmark table (no 'op', 'kernel' and 'median_s' columns)")
    return recs


def _truthy(v: Any) -> bool:
    return str(v).strip().lower() in ("true", "1", "yes")


def spmv_kernel_label(r: Mapping[str, Any]) -> str:
    """A kernel as the SpMV table names it: ``csr_vector (32 lanes, 256t)``, ``merge (secsize 5)``, ``cusparse``."""
    extra = []
    if r.get("secsize") not in (None, ""):
        extra.append(f"secsize {r['secsize']}")
    if r.get("lanes") not in (None, ""):
        extra.append(f"{r['lanes']} lanes")
    if r.get("shape") not in (None, ""):
        extra.append(str(r["shape"]))
    if _truthy(r.get("layout")):
        extra.append("interleaved")
    return str(r.get("kernel", "")) + (f" ({', '.join(extra)})" if extra else "")


#: What the columns of the SpMV benchmark table measure (printed above it).
SPMV_INTRO = (
    "Each kernel's forward projection (fp: A x) or back projection (bp: A^T y on the stored transpose; "
    "bp_notrans: from the rows of A, without one) on one GPU, timed over the benchmark's repetitions: median and "
    "fastest time in ms. kernel: its name, with the lanes per row, the launch shape (threads per block, e.g. "
    "256t; row, mb, w, u: csr_vector's tuned variants) and merge's section size where it has them. "
    "GB/s: the bytes the kernel reads over its median "
    "time; of copy: that bandwidth over the GPU's measured copy bandwidth; vs cuSPARSE: cuSPARSE's median time "
    "over the kernel's (above 1: faster than cuSPARSE); rel. L2: the result against a float64 product. "
    "*fastest*: the fastest kernel of the operation; *auto*: the one the `auto` policy runs, where the table "
    "records it.\n\n"
)


def spmv_section(paths: Iterable[Any]) -> str:
    """Markdown: the SpMV benchmark of each matrix, one readable table per file ("" without files).

    Times in ms to 3 significant digits, bandwidths in GB/s, the share of
    the copy bandwidth in percent; each kernel named with its lanes, launch
    shape or section size; per operation the fastest row and the row
    ``auto`` picks (an ``auto`` column of the table, where present) marked.
    Columns the file does not have are left out.
    """
    out = []
    for path in paths:
        p = Path(path)
        recs = spmv_rows(p)
        if not recs:
            continue
        fastest: dict[str, float] = {}
        for r in recs:
            t = _num(r.get("median_s"))
            if t is not None and t < fastest.get(r["op"], math.inf):
                fastest[r["op"]] = t
        has = set(recs[0])
        cols = [("operation", lambda r: r["op"]), ("kernel", spmv_kernel_label)]
        if "deterministic" in has:
            cols.append(("deterministic", lambda r: "yes" if _truthy(r.get("deterministic")) else "NO (atomics)"))
        cols.append(("median (ms)", lambda r: _fmt_ms(r.get("median_s"))))
        if "min_s" in has:
            cols.append(("fastest (ms)", lambda r: _fmt_ms(r.get("min_s"))))
        if "bytes" in has:
            cols.append(("MB read", lambda r: _sig3(_num(r["bytes"]) / 1e6) if _num(r.get("bytes")) else ""))
        if "bandwidth" in has:
            cols.append(("GB/s", lambda r: _sig3(_num(r["bandwidth"]) / 1e9) if _num(r.get("bandwidth")) else ""))
        if "of_copy" in has:
            cols.append(("of copy", lambda r: _fmt_pct(r.get("of_copy"))))
        if "vs_cusparse" in has:
            cols.append(("vs cuSPARSE", lambda r: _fmt_ratio(r["vs_cusparse"]) if _num(r.get("vs_cusparse")) else ""))
        if "rel_l2" in has:
            cols.append(("rel. L2", lambda r: _fmt_e(r.get("rel_l2"))))

        def mark(r: Mapping[str, Any]) -> str:
            marks = []
            if _num(r.get("median_s")) is not None and _num(r.get("median_s")) == fastest.get(r["op"]):
                marks.append("*fastest*")
            if _truthy(r.get("auto")):
                marks.append("*auto*")
            return ", ".join(marks)

        cols.append(("", mark))
        body = [[f(r) for _, f in cols] for r in recs]
        matrix = p.parent.parent.name if p.parent.name == "bench" else p.stem
        out.append(f"### {matrix}\n\nFrom `{p}`.\n\n" + _md_table([h for h, _ in cols], body))
    return "## SpMV benchmark\n\n" + SPMV_INTRO + "\n".join(out) if out else ""


def plots_section(plots: Iterable[tuple[str, str]]) -> str:
    """Markdown: each plot as an image (``![title](path)``, the path relative to ``summary.md``), under its title."""
    shown = "".join(f"### {title}\n\n![{title}]({path})\n\n" for path, title in plots)
    return "## Plots\n\n" + (shown or "none\n")


def write_convergence_csv(rows: list[dict[str, Any]], path: str | os.PathLike) -> bool:
    """Write ``convergence.csv`` (atomically): :func:`mlemlib.convergence.study_rows`.

    Returns
    -------
    bool
        Whether the file was written: without rows (no study) nothing is,
        not even a header.
    """
    from mlemlib.convergence import STUDY_COLUMNS

    if not rows:
        return False

    with atomic_path(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(STUDY_COLUMNS)
        for r in rows:
            w.writerow(["" if r.get(c) is None else (repr(r[c]) if isinstance(r[c], float) else r[c])
                        for c in STUDY_COLUMNS])
    return True


CONVERGENCE_INTRO = (
    "Each simulated measurement reconstructed with every subset count S of `convergence.subsets` for the same "
    "number of passes (a pass visits all S subsets: one MLEM iteration), measured against the phantom every "
    "`record_every` passes. *modelled*: the reconstruction models the measurement's factors m and background b; "
    "*ignored*: the same data with m = 1 and b = 0, the bias of a reconstruction that models neither. "
    "**Passes to reach MLEM's CRC**: the first recorded pass whose contrast recovery (the mean over the hot spheres, "
    "1 is perfect) reaches that of MLEM (S = 1, modelled) after its last pass (– : never, or no MLEM run). "
    "**Centre/edge**: the image's mean over the background near the centre over its mean near the edge, divided "
    "by the phantom's (1: unbiased; below 1 a centre too dark, as without attenuation correction).\n\n"
)


def convergence_section(rows: list[dict[str, Any]]) -> str:
    """Markdown: the convergence study's table (:func:`mlemlib.convergence.study_rows`), "" without a study."""
    if not rows:
        return ""
    headers = ["matrix / data", "S", "m and b", "passes", "passes to reach MLEM's CRC", "MLEM's CRC (hot)",
               "CRC hot", "CRC cold", "rel. error vs phantom", "lowest rel. error (pass)", "centre/edge", "time (s)"]
    body = []
    for r in rows:
        reach = r.get("passes_to_mlem_crc")
        body.append([
            f"{r['matrix']} / {r['data']}", r["subsets"], r["corrections"], r.get("passes"),
            "–" if reach is None else reach, _fmt_g(r.get("mlem_crc_hot"), 4), _fmt_g(r.get("crc_hot"), 4),
            _fmt_g(r.get("crc_cold"), 4), _fmt_g(r.get("rel_error"), 4),
            f"{_fmt_g(r.get('min_rel_error'), 4)} ({r.get('min_rel_error_pass')})", _fmt_g(r.get("centre_to_edge"), 4),
            _fmt_sec(r.get("seconds")),
        ])
    key = [headers.index(n) for n in ("matrix / data", "S", "m and b", "passes to reach MLEM's CRC", "CRC hot",
                                      "rel. error vs phantom", "centre/edge")]
    return ("## Convergence and bias\n\n" + CONVERGENCE_INTRO
            + _md_table([headers[k] for k in key], [[b[k] for k in key] for b in body])
            + _more("every column: the passes, MLEM's CRC, the cold CRC, the lowest error and the time")
            + _md_table(headers, body))


def map_section(groups: Mapping[tuple, list[dict[str, Any]]]) -> str:
    """Markdown: the MAP configurations (rows whose ``timings.json`` has ``map``), "" without one.

    Per configuration: the passes, Phi after the last pass and, where some
    run recorded the convergence metrics (``map.metrics``,
    :mod:`mlemlib.map_metrics`), the time to threshold: the iteration time
    until both RMSEs are below 1% and every sphere's mean below 0.5% of the
    converged image's, and its passes (``never`` where not reached, ``–``
    where not measured).
    """
    maps = [rs for rs in groups.values() if rs[0].get("map_algorithm")]
    if not maps:
        return ""
    problems = _problems(dict(enumerate(maps)))
    measured = any(has_map_metrics(r) for rs in maps for r in rs)
    head = [*(["matrix / data"] if len(problems) > 1 else []), "configuration", "passes", "Phi (last pass)",
            *(["time to threshold (s)", "passes to threshold"] if measured else [])]
    body = []
    for rs in maps:
        r0 = rs[0]
        timed = [r for r in rs if has_map_metrics(r) and r.get("repetition") == r["_map"]["metrics"].get("repetition", 0)]
        if not timed:
            reach = ["–", "–"]
        elif timed[0].get("time_to_threshold_s") is None:
            reach = ["never", "never"]
        else:
            reach = [_fmt_sec(timed[0]["time_to_threshold_s"]), str(timed[0]["passes_to_threshold"])]
        body.append([*([f"{r0['matrix']} / {r0['data']}"] if len(problems) > 1 else []), config_label(r0),
                     r0.get("iterations"), _fmt_g(r0.get("phi"), 9), *(reach if measured else [])])
    intro = ((f"{problems[0]}: " if len(problems) == 1 else "")
             + "each MAP configuration's passes and its objective Phi = L - beta R after the last pass"
             + (". Time to threshold: the summed iteration time of the passes until, measured against the "
                "converged MAP image of the same problem, the RMSE over the phantom's object and over its "
                "background are both below 1% of that image's mean there and every sphere's mean is within 0.5% "
                "of that image's (the first pass at which all hold; never: not within the run; –: not measured)"
                if measured else "") + ".\n\n")
    return "## MAP\n\n" + intro + _md_table(head, body)
