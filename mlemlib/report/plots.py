"""The summary's figures, as PNG files (host; matplotlib, Agg).

``time_per_iteration.png`` (:func:`plot_times`), ``time_distribution.png``
(:func:`plot_distribution`), ``accuracy.png`` (:func:`plot_accuracy`),
``scaling.png`` (:func:`plot_scaling`), ``time_vs_gpus.png``
(:func:`plot_time_vs_gpus`), ``image_<matrix>_<data>.png``
(:func:`plot_image`), and for MAP runs ``map_objective.png``
(:func:`plot_map_objective`) and ``map_metrics.png`` (:func:`plot_map_metrics`). Each figure carries its legend outside the axes and a
note under it that says what its marks and labels mean; every series has a
colour of its own; times that differ by more than :data:`PANEL_RATIO` are
drawn on separate axes or a log axis, so that no bar is too small to see.
"""

from __future__ import annotations

import logging
import math
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from mlemlib.errors import InputError
from mlemlib.report.rows import (
    STEPS,
    _family,
    _mean,
    _num,
    _scaling_key,
    config_label,
    has_map_metrics,
    label_terms,
    scaling_label,
    scaling_table,
)

log = logging.getLogger(__name__)

#: Times more than this factor apart go on separate axes (time per iteration) or a log axis.
PANEL_RATIO = 20.0

def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", str(text)).strip("_") or "x"


def labels_note(rows: Iterable[Mapping[str, Any]]) -> str:
    """The key to the configuration labels of a plot's ``rows``: only the terms those labels use
    (:func:`mlemlib.report.rows.label_terms`); "" without any."""
    terms = label_terms(rows)
    return ("Labels: " + "; ".join(terms) + ".") if terms else ""


def _plot_labels(groups: Mapping[tuple, list[dict[str, Any]]]) -> tuple[list[str], str]:
    """Axis labels of the configurations, and the problem they share (for the title; "" if several)."""
    problems = [f"{rs[0]['matrix']} / {rs[0]['data']}" for rs in groups.values()]
    labels = [config_label(rs[0]) for rs in groups.values()]
    if len(set(problems)) == 1:
        return labels, problems[0]
    return [f"{p}\n{label}" for p, label in zip(problems, labels)], ""


def _add_key(fig: Any, text: str, width: int = 130, below: Any = None) -> None:
    """Lay the figure out, then put a wrapped explanatory note under it (kept by :func:`_save`); under the
    artist ``below`` (a figure legend placed under the figure) where given."""
    import textwrap

    if fig.get_layout_engine() is None:  # not laid out by constrained layout
        fig.tight_layout()
    y = -0.01
    if below is not None:
        fig.canvas.draw()
        y = below.get_window_extent().transformed(fig.transFigure.inverted()).y0 - 0.01
    fig.text(0.01, y, textwrap.fill(text, width), fontsize=7, va="top", ha="left", color="0.25")


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


def time_panels(times: list[float | None], ratio: float = PANEL_RATIO) -> list[list[int]]:
    """Indices of ``times`` split into panels whose times are at most ``ratio`` apart, fastest panel first.

    Within a panel the indices keep their order; a missing time joins the
    first panel.
    """
    known = sorted((t, k) for k, t in enumerate(times) if t is not None and t > 0)
    panel_of: dict[int, int] = {}
    start = None
    panel = -1
    for t, k in known:
        if start is None or t > start * ratio:
            start, panel = t, panel + 1
        panel_of[k] = panel
    panels: list[list[int]] = [[] for _ in range(max(panel, 0) + 1)]
    for k in range(len(times)):
        panels[panel_of.get(k, 0)].append(k)
    return panels


def _time_unit(ms: float) -> tuple[str, float]:
    """The unit to show times of up to ``ms`` milliseconds in, and its factor from ms."""
    if ms >= 1000.0:
        return "s", 1e-3
    if ms < 0.1:
        return "us", 1e3
    return "ms", 1.0


_STEP_COLORS = {"fp": "tab:blue", "corr": "tab:orange", "bp": "tab:green", "update": "tab:red",
                "map": "tab:brown", "allreduce": "tab:purple", "iteration": "0.75"}
_STEP_NAMES = {"fp": "fp: forward projection A f", "corr": "corr: g / (A f)", "bp": "bp: back projection A^T c",
               "update": "update: f * bp / norm",
               "map": "map: the prior's gradient and the MAP step", "allreduce": "allreduce: between GPUs",
               "iteration": "whole iteration (its steps not timed within it)"}


def plot_times(groups: Mapping[tuple, list[dict[str, Any]]], path: Path) -> None:
    """Stacked bars of the mean step times per configuration, a circle per repetition's mean.

    Configurations whose times differ by more than :data:`PANEL_RATIO`
    (a GPU run of 1 ms beside a float64 reference of 3 s) are drawn in
    separate panels, each with its own time axis and unit, so that every bar
    can be read. The legend sits outside the axes (it hides no point) and a
    key under the plot says what the configuration labels mean.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    labels, problem = _plot_labels(groups)
    rs_list = list(groups.values())
    totals = [_mean(r["iteration_mean_s"] for r in rs) for rs in rs_list]
    panels = time_panels(totals)
    heights = [0.6 + 0.5 * len(p) for p in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 0.6 + sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    axes = [a[0] for a in axes]
    used: list[str] = []
    for ax, members in zip(axes, panels):
        peak = max((t for k in members for t in [totals[k]] if t), default=0.0) * 1e3
        reps = [r["iteration_mean_s"] * 1e3 for k in members for r in rs_list[k] if r["iteration_mean_s"] is not None]
        unit, scale = _time_unit(max([peak, *reps]))
        y = np.arange(len(members))
        left = np.zeros(len(members))
        for s in STEPS:
            # steps timed kernel by kernel after a graph run sum to more than its replayed iterations: not stacked
            vals = np.array([0.0 if rs_list[k][0].get("steps_from") else
                             (_mean(r[f"{s}_mean_s"] for r in rs_list[k]) or 0.0) * 1e3 * scale for k in members])
            if vals.any():
                ax.barh(y, vals, left=left, color=_STEP_COLORS[s], height=0.6)
                left += vals
                if s not in used:
                    used.append(s)
        whole = np.array([(totals[k] or 0.0) * 1e3 * scale if not left[row] else 0.0
                          for row, k in enumerate(members)])
        if whole.any():  # configurations that timed only the whole iteration (graph capture)
            ax.barh(y, whole, color="0.75", height=0.6)
            if "iteration" not in used:
                used.append("iteration")
        for row, k in enumerate(members):
            pts = [r["iteration_mean_s"] * 1e3 * scale for r in rs_list[k] if r["iteration_mean_s"] is not None]
            ax.plot(pts, [row] * len(pts), "o", color="black", mfc="white", ms=5, zorder=3)
        ax.set_yticks(y, [labels[k] for k in members], fontsize=8)
        ax.set_ylim(len(members) - 0.5, -0.5)
        ax.set_xlim(left=0)
        ax.set_xlabel(f"time per iteration ({unit})", fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    handles = [Patch(color=_STEP_COLORS[s], label=_STEP_NAMES[s]) for s in (*STEPS, "iteration") if s in used]
    handles.append(plt.Line2D([], [], ls="", marker="o", color="black", mfc="white", ms=5,
                              label="one repetition's mean time per iteration"))
    axes[0].legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    axes[0].set_title("Time per iteration by configuration" + (f": {problem}" if problem else ""))
    note = ("Bars: the mean of each step over all iterations and repetitions, stacked. "
            + (f"Configurations whose times differ by more than {PANEL_RATIO:g}x are in separate panels, each "
               "with its own time axis. " if len(panels) > 1 else ""))
    _add_key(fig, note + labels_note(r for rs in rs_list for r in rs))
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
    if lo > 0 and hi / lo > PANEL_RATIO:
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
    beyond = bool(data) and any(v > hi or v < lo for vals in data for v in vals)
    _add_key(fig, "Boxes: median and quartiles; whiskers: the furthest iteration within 1.5 times the box's "
                  "width; circles: iterations beyond the whiskers"
                  + ("; a red triangle at the edge: iterations beyond the plotted range, with their times"
                     if beyond else "") + ". " + labels_note(r for rs in shown.values() for r in rs))
    _save(fig, path)


def _beyond(vals: list[float]) -> str:
    """Label of outliers beyond the plotted range: their count and times (ms)."""
    shown = ", ".join(f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"  # 30720, not 3.072e+04
                      for v in (vals if len(vals) <= 3 else [vals[0], vals[-1]]))
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
    _add_key(fig, labels_note(r for rs in groups.values() for r in rs), width=160)
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
    """Speed-up against GPUs, one line per configuration and layout, and y = P. False (nothing written) if no line.

    Every line has a colour of its own (dashed: the thesis layout), named in
    the legend beside the axes.
    """
    import matplotlib.pyplot as plt

    rows = list(rows)
    lines = scaling_series(rows)
    if not lines:
        return False
    counts = sorted({p for pts in lines.values() for p, _ in pts})
    fig, ax = plt.subplots(figsize=(7.5, 5))
    ax.plot(counts, counts, color="0.6", ls=":", label="ideal (speed-up = P)")
    for k, ((conf, layout), pts) in enumerate(lines.items()):
        ax.plot([p for p, _ in pts], [s for _, s in pts], marker="o", color=_series_color(k),
                ls="--" if layout == "thesis" else "-", label=f"{conf}, {layout} layout")
    ax.set_xticks(counts, [str(p) for p in counts])
    ax.set_xlabel("GPUs (P)")
    ax.set_ylabel("speed-up T(1) / T(P)")
    ax.set_title("MLEM scaling over GPUs (mean time per iteration)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    layouts = {layout for _, layout in lines}
    meaning = [m for lay, m in (("local", "local: one all-reduce of the image per iteration"),
                                ("thesis", "thesis, dashed: one after each projection")) if lay in layouts]
    _add_key(fig, "One line per configuration and multi-GPU layout (" + "; ".join(meaning) + "), from the "
                  "configuration's 1-GPU run; the dotted line is the ideal speed-up P. "
                  + labels_note(r for r in rows if not r.get("reference_mode")
                                and _family(r.get("backend")) == "cuda"), width=110)
    _save(fig, path)
    return True


def _series_color(k: int) -> Any:
    """The colour of the ``k``-th series: tab10, then tab20's lighter shades, then a cycle of both."""
    import matplotlib

    palette = list(matplotlib.colormaps["tab10"].colors) + list(matplotlib.colormaps["tab20"].colors[1::2])
    return palette[k % len(palette)]


def time_vs_gpus_series(rows: Iterable[Mapping[str, Any]]) -> OrderedDict[tuple[str, str], dict[int, list[float]]]:
    """Time per iteration (s) against the GPU count, per configuration and layout (``plots/time_vs_gpus.png``).

    Keys are ``("{matrix}/{data} {configuration}", layout)`` as in
    :func:`scaling_series`; values map a GPU count to each repetition's
    ``iteration_mean_s``. A configuration's 1-GPU runs start each of its
    layouts' lines (one GPU has no layout); cuda runs only, the reference left
    out.
    """
    rows = [r for r in rows if not r.get("reference_mode") and _family(r.get("backend")) == "cuda"
            and r.get("iteration_mean_s") is not None]
    groups: dict[tuple, list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault(_scaling_key(r), []).append(r)
    names = {key: scaling_label(rs) for key, rs in groups.items()}
    cells: OrderedDict[tuple[str, int, str], list[float]] = OrderedDict()
    for r in rows:
        conf = f"{r['matrix']}/{r['data']} {names[_scaling_key(r)]}"
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
    times: list[float] = []
    counts: set[int] = set()
    for k, ((conf, layout), pts) in enumerate(lines.items()):
        color = _series_color(k)
        xs = list(pts)
        means = [float(np.mean(v)) * 1e3 for v in pts.values()]
        ax.plot(xs, means, marker="s", ms=5, color=color, ls="--" if layout == "thesis" else "-",
                label=f"{conf}, {layout} layout")
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
    if times and min(times) > 0 and max(times) / min(times) > PANEL_RATIO:
        ax.set_yscale("log")
        ax.set_ylabel("time per iteration (ms, log scale)")
    else:
        ax.set_ylim(bottom=0, top=max(times) * 1.1 if times else None)
        ax.set_ylabel("time per iteration (ms)")
    ax.set_xticks(sorted(counts), [str(p) for p in sorted(counts)])
    ax.set_xlim(0.5, max(counts) + 0.5)
    ax.set_xlabel("GPUs (P)")
    ax.set_title("Time per iteration against the number of GPUs")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    dashed = any(layout == "thesis" for _, layout in lines)
    starred = any(run.matrix.shape in shapes for run in thesis.RUNS)
    _add_key(fig, "Squares joined by a line: the mean over repetitions of each configuration and layout"
                  + (" (dashed: the thesis layout)" if dashed else "") + "; circles: each repetition's mean time "
                  "per iteration" + ("; a star: the thesis's run on a matrix of the same shape (the sum of its "
                                     "published step times)" if starred else "") + ". "
                  + labels_note(r for r in rows if not r.get("reference_mode") and _family(r.get("backend")) == "cuda"),
                  width=110)
    _save(fig, path)
    return True


#: Colour-bar label of the image plots: what a voxel value measures.
IMAGE_UNITS = "activity per voxel (A f = expected counts per LOR)"

#: The note under the image plots; :data:`IMAGE_SCALE` or :data:`IMAGE_SCALE_NO_TRUTH` follows it.
IMAGE_NOTE = (
    "Central slices through the field of view, centred on 0. A voxel's value is the activity MLEM estimates, in "
    "the units A gives it: A f is the expected number of counts of each LOR (for the scanner presets, whose "
    "elements are chord lengths in mm, counts per mm of chord). "
)
#: How the grey scale is set, beside a truth.
IMAGE_SCALE = ("Truth and reconstruction share one grey scale, from 0 to the 99.9th percentile of both (the arrow: "
               "brighter voxels).")
#: How the grey scale is set for several reconstructions (with or without the truth).
IMAGE_SCALE_ALL = ("Every row shares one grey scale, from 0 to the 99.9th percentile of them all (the arrow: "
                   "brighter voxels).")
#: How the grey scale is set, without one (a measurement of the user's: nothing to compare with).
IMAGE_SCALE_NO_TRUTH = "The grey scale runs from 0 to the image's 99.9th percentile (the arrow: brighter voxels)."


def _axis_mm(count: int, size: float) -> tuple[float, float]:
    """Extent (mm) of ``count`` voxels of ``size`` mm, centred on 0 (as the phantoms are)."""
    return -count * size / 2.0, count * size / 2.0


def _centre_mm(count: int, size: float) -> float:
    """Position (mm) of the centre of the central voxel ``count // 2``."""
    return (count // 2 + 0.5 - count / 2.0) * size


def plot_image(image_path: Any, truth_path: Any, path: Path, title: str, *, name: str = "reconstruction",
               beside: Iterable[tuple[str, Any]] = ()) -> bool:
    """Central axial, coronal and sagittal slices of an image (and of the truth above it). False if unreadable.

    Axes in mm (the field of view centred on 0; in voxels where the image
    has no voxel size), one colour scale shared by truth and reconstruction
    (0 to the 99.9th percentile of both) and one colour bar with the units. Without a truth (none given,
    or unreadable) the figure and its note show and speak of the reconstruction only. ``name`` titles
    the image's row; ``beside``: ``(name, image.h5)`` of further reconstructions of the same problem
    (a MAP image beside OSEM's), each a row below it on the same scale (an unreadable one left out).
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
    vols.append((name, img.reshape(gz, gy, gx)))
    for other, other_path in beside:
        try:
            o, _ = read_image(other_path, expected_length=img.size)
            vols.append((other, o.reshape(gz, gy, gx)))
        except InputError as exc:
            log.warning("%s not shown: %s", other, exc)
    voxel = attrs.get("voxel_size")
    unit = "mm" if voxel else "voxels"
    vx, vy, vz = (float(v) for v in voxel) if voxel else (1.0, 1.0, 1.0)
    ex, ey, ez = _axis_mm(gx, vx), _axis_mm(gy, vy), _axis_mm(gz, vz)
    vmax = max(float(np.percentile(v, 99.9)) for _, v in vols) or max(float(v.max()) for _, v in vols) or 1.0
    # Panels as large as their slices (axial x by y, coronal x by z, sagittal y by z), packed without gaps:
    # where the field of view is short in z, the coronal and sagittal slices stack beside the axial one.
    wx, wy, wz = gx * vx, gy * vy, gz * vz
    stacked = 2 * wz <= 1.3 * wy
    if stacked:
        row_h = max(wz, wy / 2)
        mosaic = [row for k in range(len(vols)) for row in ([f"a{k}", f"c{k}"], [f"a{k}", f"s{k}"])]
        widths, heights = [wx, max(wx, wy)], [row_h] * (2 * len(vols))
    else:
        mosaic = [[f"a{k}", f"c{k}", f"s{k}"] for k in range(len(vols))]
        widths, heights = [wx, wx, wy], [max(wy, wz)] * len(vols)
    width_in = 8.0 if stacked else 11.0
    height_in = min(width_in * sum(heights) / sum(widths) * 1.05 + 0.9 * len(vols), 14.0)
    fig, panel = plt.subplot_mosaic(mosaic, figsize=(width_in + 1.2, height_in), width_ratios=widths,
                                    height_ratios=heights, layout="constrained")
    for row, (name, v) in enumerate(vols):
        slices = [
            ("a", f"axial, z = {_centre_mm(gz, vz):g} {unit}", v[gz // 2], (*ex, *ey), "x", "y"),
            ("c", f"coronal, y = {_centre_mm(gy, vy):g} {unit}", v[:, gy // 2, :], (*ex, *ez), "x", "z"),
            ("s", f"sagittal, x = {_centre_mm(gx, vx):g} {unit}", v[:, :, gx // 2], (*ey, *ez), "y", "z"),
        ]
        for key, sname, sl, extent, xl, yl in slices:
            ax = panel[f"{key}{row}"]
            im = ax.imshow(sl, cmap="gray", vmin=0, vmax=vmax, origin="lower", extent=extent,
                           interpolation="nearest")
            ax.set_title(f"{name}: {sname}", fontsize=8)
            ax.set_xlabel(f"{xl} ({unit})", fontsize=7)
            ax.set_ylabel(f"{yl} ({unit})", fontsize=7)
            ax.tick_params(labelsize=7)
    bar = fig.colorbar(im, ax=list(panel.values()), shrink=0.85, extend="max", aspect=30)
    bar.set_label(IMAGE_UNITS, fontsize=8)
    bar.ax.tick_params(labelsize=7)
    fig.suptitle(title, fontsize=9)
    truth_shown = vols[0][0] == "truth"
    scale = (IMAGE_SCALE if truth_shown and len(vols) == 2 else IMAGE_SCALE_ALL if len(vols) > 1
             else IMAGE_SCALE_NO_TRUTH)
    _add_key(fig, IMAGE_NOTE + scale, width=150)
    _save(fig, path, dpi=100)
    return True




def convergence_note(record: Mapping[str, Any]) -> str:
    """The note under a convergence figure: what its lines and panels mean, only the terms it shows."""
    series = [s for s in record.get("series", []) if s.get("passes")]
    counts = sorted({int(s["subsets"]) for s in series})
    ignored = any(not s["corrected"] for s in series)
    osem = any(S > 1 for S in counts)
    text = ("A pass visits all S subsets once (one MLEM iteration; S OSEM sub-iterations). " if osem else
            "A pass is one MLEM iteration. ")
    if ignored:
        text += ("Solid: the reconstruction models the measurement's factors m (attenuation, normalisation) and "
                 "background b (randoms, scatter); dashed: the same data reconstructed with m = 1 and b = 0. ")
    text += ("Contrast recovery: the mean over the phantom's hot spheres of (C_sphere / C_background - 1) / "
             "(true ratio - 1), 1 is perfect")
    text += ("; dotted: MLEM's after its last pass, the target of the table's 'passes to reach'. "
             if any(S == 1 and s["corrected"] for s in series for S in [int(s["subsets"])]) else ". ")
    text += ("Relative error: ||f - truth|| / ||truth||. Profile: the mean along x through the phantom's centre "
             "of the last pass" + (" of the smallest S" if len(counts) > 1 else "") + ", beside the phantom.")
    return text


def convergence_figure(record: Mapping[str, Any]) -> Any:
    """The figure of :func:`plot_convergence` (a matplotlib Figure), or None for a record without series."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator

    series = [s for s in record.get("series", []) if s.get("passes")]
    if not series:
        return None
    counts = sorted({int(s["subsets"]) for s in series})
    colour = {S: _series_color(k) for k, S in enumerate(counts)}
    ignored = any(not s["corrected"] for s in series)
    fig, axes = plt.subplots(1, 3, figsize=(15, 5.2), layout="constrained",
                             gridspec_kw={"width_ratios": [1, 1, 1.1]})
    ax_crc, ax_err, ax_prof = axes
    for s in series:
        label = ("MLEM" if s["subsets"] == 1 else f"OSEM S={s['subsets']}") + (
            (", m and b modelled" if s["corrected"] else ", m and b ignored") if ignored else "")
        kw = {"color": colour[int(s["subsets"])], "linestyle": "-" if s["corrected"] else "--", "label": label,
              "marker": "o" if len(s["passes"]) <= 12 else None, "markersize": 3}
        ax_crc.plot(s["passes"], s["crc_hot"], **kw)
        ax_err.plot(s["passes"], s["rel_error"], **kw)
    mlem = next((s for s in series if s["subsets"] == 1 and s["corrected"]), None)
    if mlem is not None and mlem["crc_hot"] and math.isfinite(mlem["crc_hot"][-1]):
        ax_crc.axhline(mlem["crc_hot"][-1], color="0.3", linestyle=":", linewidth=1,
                       label=f"MLEM after {mlem['passes'][-1]} passes")
    ax_crc.set(xlabel="pass", ylabel="contrast recovery, hot spheres (mean)", title="Contrast recovery per pass")
    ax_err.set(xlabel="pass", ylabel="relative L2 error against the phantom", title="Error against the phantom per pass")
    if all(v > 0 for s in series for v in s["rel_error"] if v is not None and math.isfinite(v)):
        ax_err.set_yscale("log")
        # plain numbers at 1, 2, 5 of each decade: a narrow range still has labelled ticks
        ax_err.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))
        ax_err.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:.3g}"))
        ax_err.yaxis.set_minor_formatter(FuncFormatter(lambda v, _pos: ""))
    smallest = counts[0]
    vx = float((record.get("voxel_size") or [1.0])[0])
    truth = record.get("profile_truth") or []
    x = (np.arange(len(truth)) + 0.5 - len(truth) / 2) * vx
    ax_prof.plot(x, truth, color="black", linewidth=1.5, label="phantom")
    for s in series:
        if int(s["subsets"]) == smallest and s.get("profile"):
            ax_prof.plot(x, s["profile"], color=colour[smallest], linestyle="-" if s["corrected"] else "--",
                         label=("MLEM" if smallest == 1 else f"OSEM S={smallest}")
                         + ((", m and b modelled" if s["corrected"] else ", m and b ignored") if ignored else ""))
    ax_prof.set(xlabel="x (mm)", ylabel="activity per voxel (mean along the profile)",
                title=f"Profile through the centre, pass {record.get('iterations')}")
    ax_prof.yaxis.set_major_locator(MaxNLocator(6))
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelleft=True, labelbottom=True)
    # one legend under the two panels whose lines it names, one under the profile
    handles, labels = ax_crc.get_legend_handles_labels()
    ax_crc.legend(handles, labels, loc="upper left", bbox_to_anchor=(0.0, -0.14), ncol=min(3, len(labels)),
                  fontsize=8, borderaxespad=0, frameon=False)
    ax_prof.legend(loc="upper left", bbox_to_anchor=(0.0, -0.14), ncol=1, fontsize=8, borderaxespad=0,
                   frameon=False)
    fig.suptitle(f"Convergence and bias: {record.get('matrix')} / {record.get('data')}")
    return fig


def plot_convergence(record: Mapping[str, Any], path: Path) -> bool:
    """Contrast recovery and relative error against the phantom per pass for each S, and a profile through the centre.

    One figure of a :func:`mlemlib.convergence.study` record
    (:func:`convergence_figure`): three panels (hot contrast recovery per
    pass, relative L2 error against the phantom per pass on a log axis, and
    a profile through the centre), one colour per S, solid where m and b are
    modelled and dashed where they are ignored; the legend of the first two
    panels under them, the profile's under it; every axis labelled; the note
    under the figure (:func:`convergence_note`) speaks only of what it shows.
    Returns False (nothing written) for a record without series.
    """
    fig = convergence_figure(record)
    if fig is None:
        return False
    _add_key(fig, convergence_note(record), width=170)
    _save(fig, path)
    return True


def _map_groups(groups: Mapping[tuple, list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    return [rs for rs in groups.values() if rs[0].get("map_algorithm") and (rs[0].get("_map") or {}).get("history")]


def _map_line_labels(maps: list[list[dict[str, Any]]]) -> list[str]:
    problems = {(rs[0]["matrix"], rs[0]["data"]) for rs in maps}
    return [(f"{rs[0]['matrix']} / {rs[0]['data']}: " if len(problems) > 1 else "") + config_label(rs[0])
            for rs in maps]


def plot_map_objective(groups: Mapping[tuple, list[dict[str, Any]]], path: Path) -> bool:
    """Phi, the log-likelihood L and the prior R per pass of every MAP configuration (``map.history``).

    Three panels side by side, one colour per configuration (pass 0: the
    initial image); the legend under them, the note under the figure
    naming only what it shows. Returns False (nothing written) where no
    configuration recorded a history.
    """
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    maps = _map_groups(groups)
    if not maps:
        return False
    labels = _map_line_labels(maps)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8), layout="constrained")
    keys = (("phi", "Phi = L - beta R"), ("log_likelihood", "log-likelihood L"), ("prior", "prior R"))
    for k, (rs, label) in enumerate(zip(maps, labels)):
        hist = [h for h in rs[0]["_map"]["history"] if isinstance(h, dict)]
        passes = [h.get("pass") for h in hist]
        for ax, (key, _) in zip(axes, keys):
            ax.plot(passes, [_num(h.get(key)) if _num(h.get(key)) is not None else np.nan for h in hist],
                    color=_series_color(k), label=label, marker="o" if len(hist) <= 12 else None, markersize=3)
    for ax, (_, name) in zip(axes, keys):
        ax.set(xlabel="pass", ylabel=name, title=f"{name} per pass")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # passes are whole numbers
        ax.grid(True, alpha=0.3)
    # the legend under the whole figure (under one panel, its width would widen that panel's column), the note
    # under the legend
    handles, names = axes[0].get_legend_handles_labels()
    legend = fig.legend(handles, names, loc="upper left", bbox_to_anchor=(0.01, -0.01), ncol=1, fontsize=8,
                        frameon=False, borderaxespad=0)
    problems = {(rs[0]["matrix"], rs[0]["data"]) for rs in maps}
    fig.suptitle("MAP objective per pass" + (f": {maps[0][0]['matrix']} / {maps[0][0]['data']}"
                                             if len(problems) == 1 else ""))
    note = ("Pass 0 is the initial image; a pass visits every subset once. L is the Poisson log-likelihood "
            "without its constant, R the prior, beta its weight; MAP maximises Phi.")
    _add_key(fig, " ".join(t for t in (note, labels_note([rs[0] for rs in maps])) if t), width=170, below=legend)
    _save(fig, path)
    return True


def plot_map_metrics(groups: Mapping[tuple, list[dict[str, Any]]], path: Path) -> bool:
    """The convergence metrics per pass of every MAP configuration that recorded them (``map.metrics``).

    Three panels on log y axes, one colour per configuration: the RMSE over
    the phantom's object and over its background (each relative to the
    converged image's mean there) with the 1% threshold, and the largest
    relative error of a sphere's mean with the 0.5% threshold (where the phantom has spheres). Returns False
    (nothing written) where no configuration recorded metrics.
    """
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from mlemlib.map_metrics import RMSE_THRESHOLD, SPHERE_THRESHOLD

    maps = [rs for rs in _map_groups(groups) if any(has_map_metrics(r) for r in rs)]
    if not maps:
        return False
    labels = _map_line_labels(maps)
    records = [next(r for r in rs if has_map_metrics(r))["_map"]["metrics"] for rs in maps]
    spheres_any = any(m.get("spheres") for m in records)
    fig, axes = plt.subplots(1, 3 if spheres_any else 2, figsize=(15 if spheres_any else 10.5, 4.8),
                             layout="constrained")
    for k, (rs, label) in enumerate(zip(maps, labels)):
        m = records[k]
        passes = m["passes"]
        kw = {"color": _series_color(k), "label": label, "marker": "o" if len(passes) <= 12 else None,
              "markersize": 3}

        def clean(vals: Iterable[Any]) -> list[float]:
            return [_num(v) if _num(v) is not None and _num(v) > 0 else np.nan for v in vals]

        axes[0].plot(passes, clean(m["rmse_object"]), **kw)
        axes[1].plot(passes, clean(m["rmse_background"]), **kw)
        spheres = [v for v in (m.get("spheres") or {}).values()]
        if spheres:
            worst = [max((_num(v[j]) if _num(v[j]) is not None else math.inf) for v in spheres)
                     for j in range(len(passes))]
            axes[2].plot(passes, clean(worst), **kw)
    titles = ("RMSE over the object", "RMSE over the background", "largest sphere mean error")
    ylabels = ("RMSE / converged mean (object)", "RMSE / converged mean (background)",
               "max over spheres |mean - converged mean| / converged mean")
    for ax, title, ylabel, limit in zip(axes, titles, ylabels, (RMSE_THRESHOLD, RMSE_THRESHOLD, SPHERE_THRESHOLD)):
        ax.axhline(limit, color="0.3", linestyle=":", linewidth=1, label=f"threshold {100 * limit:g}%")
        ax.set_yscale("log")
        ax.set(xlabel="pass", ylabel=ylabel, title=title)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    legend = fig.legend(handles, names, loc="upper left", bbox_to_anchor=(0.01, -0.01), ncol=1, fontsize=8,
                        frameon=False, borderaxespad=0)
    problems = {(rs[0]["matrix"], rs[0]["data"]) for rs in maps}
    fig.suptitle("MAP convergence per pass" + (f": {maps[0][0]['matrix']} / {maps[0][0]['data']}"
                                               if len(problems) == 1 else ""))
    note = ("Measured against the converged MAP image of the same problem; dotted: the thresholds of the "
            "time to threshold (both RMSEs below 1%" + (", every sphere below 0.5%" if spheres_any else "") + ").")
    _add_key(fig, " ".join(t for t in (note, labels_note([rs[0] for rs in maps])) if t), width=170, below=legend)
    _save(fig, path)
    return True
