"""The summary of many runs, written in one call: :func:`summarize` (host; csv, matplotlib Agg, Python-Markdown).

It reads the runs' records (:mod:`mlemlib.report.rows`), writes ``runs.csv``
and the Markdown sections (:mod:`mlemlib.report.tables`), the figures
(:mod:`mlemlib.report.plots`) and the HTML pages (:mod:`mlemlib.report.html`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mlemlib._io import atomic_dir, atomic_path
from mlemlib.errors import InputError
from mlemlib.report.html import markdown_page, runs_html
from mlemlib.report.plots import (
    _slug,
    plot_accuracy,
    plot_convergence,
    plot_distribution,
    plot_image,
    plot_map_metrics,
    plot_map_objective,
    plot_scaling,
    plot_time_vs_gpus,
    plot_times,
)
from mlemlib.report.rows import (
    config_label,
    group_rows,
    join_reference_accuracy,
    load_timings,
    map_label,
    run_image,
    run_rows,
    transpose_rows,
)
from mlemlib.report.tables import (
    accuracy_section,
    convergence_section,
    lossy_section,
    map_section,
    overview_section,
    plan_section,
    plots_section,
    scaling_section,
    spmv_section,
    thesis_section,
    timing_section,
    transpose_section,
    write_convergence_csv,
    write_runs_csv,
)

log = logging.getLogger(__name__)

#: The plots' titles in the summary, by file name (an image plot's title is its problem).
PLOT_TITLES = {
    "time_per_iteration.png": "Time per iteration by configuration",
    "time_distribution.png": "Distribution of the time per iteration",
    "accuracy.png": "Accuracy over repetitions",
    "scaling.png": "Scaling over GPUs",
    "time_vs_gpus.png": "Time per iteration against the number of GPUs",
    "map_objective.png": "MAP objective per pass",
    "map_metrics.png": "MAP convergence per pass",
}


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
    convergence: Iterable[Any] = (),
    out_csv: str | os.PathLike | None = None,
    out_convergence: str | os.PathLike | None = None,
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
        The float64 references: their ``timings.json`` (rows of their own) and
        their ``image.h5``, against which each run of the same problem and
        iteration count is measured here (:func:`join_reference_accuracy`:
        the run itself does not wait for its reference).
    exact_references
        ``results/{matrix}/runs/{data}/reference-exact/image.h5``: the float64
        reference on the lossless source of a lossy-format matrix
        (:func:`lossy_section`).
    plans
        ``plan.json`` files (or their directories) of the partitions.
    transposes
        ``transpose.h5`` files (their ``method``/``seconds`` attributes).
    bench
        SpMV benchmark tables (``spmv.csv``), shown in ms with each kernel named (:func:`spmv_section`).
    convergence
        Records of convergence studies (:func:`mlemlib.convergence.study`'s JSON files): their table
        (:func:`convergence_section`, and ``out_convergence``: ``convergence.csv``, default beside
        ``runs.csv``, written only where a study has rows: no header-only file) and one figure each,
        ``plots/convergence_<matrix>_<data>.png``.
    name
        Name of the configuration (the workflow's ``name``), shown in the titles.

    Returns
    -------
    dict
        ``rows`` (number of rows), ``configurations``, and the written paths
        (``runs_csv``, ``convergence_csv``: None where not written, ``summary_md``, ``summary_html``,
        ``runs_html``, ``plots``: list of PNG paths).

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

    references = list(references)
    ref_images = [r for r in references if os.fspath(r).endswith((".h5", ".hdf5"))]
    refs = [r for r in references if r not in ref_images]
    loaded = join_reference_accuracy(load_timings([*runs, *timings, *refs]), ref_images)
    rows = run_rows(loaded)
    groups = group_rows(rows)
    trows = transpose_rows(transposes, transpose_benchmarks)
    log.info("summarising %d runs (%d rows, %d configurations)", len(loaded), len(rows), len(groups))

    write_runs_csv(rows, csv_path)
    from mlemlib.convergence import read_study, study_rows

    studies = [read_study(p) for p in convergence]
    conv_rows = study_rows(studies)
    conv_path = Path(out_convergence) if out_convergence is not None else csv_path.with_name("convergence.csv")
    wrote_convergence = write_convergence_csv(conv_rows, conv_path)

    plot_names: dict[str, str] = {}  # file name -> title
    import matplotlib

    matplotlib.use("Agg")
    with atomic_dir(plots_dir) as tmp:
        if groups:
            plot_times(groups, tmp / "time_per_iteration.png")
            plot_distribution(groups, tmp / "time_distribution.png")
            plot_accuracy(groups, tmp / "accuracy.png")
            plot_names.update((p, PLOT_TITLES[p]) for p in ("time_per_iteration.png", "time_distribution.png",
                                                            "accuracy.png"))
            if plot_scaling(rows, tmp / "scaling.png"):
                plot_names["scaling.png"] = PLOT_TITLES["scaling.png"]
            if plot_time_vs_gpus(rows, tmp / "time_vs_gpus.png"):
                plot_names["time_vs_gpus.png"] = PLOT_TITLES["time_vs_gpus.png"]
            for fname, plot in (("map_objective.png", plot_map_objective), ("map_metrics.png", plot_map_metrics)):
                if plot(groups, tmp / fname):
                    plot_names[fname] = PLOT_TITLES[fname]
        plot_names.update(_image_plots(rows, tmp))
        for rec in studies:
            fname = f"convergence_{_slug(rec['matrix'])}_{_slug(rec['data'])}.png"
            if plot_convergence(rec, tmp / fname):
                plot_names[fname] = f"Convergence and bias: {rec['matrix']} / {rec['data']}"

    sections = [
        overview_section(groups, rows),
        timing_section(groups) if groups else "No runs.\n",
        scaling_section(rows),
        thesis_section(rows),
        accuracy_section(groups) if groups else "",
        convergence_section(conv_rows),
        map_section(groups),
        lossy_section(rows, exact_references),
        transpose_section(trows),
        plan_section(plans),
        spmv_section(bench),
        plots_section((Path(os.path.relpath(plots_dir, md_path.parent)).joinpath(p).as_posix(), t)
                      for p, t in plot_names.items()),
    ]
    n_refs = sum(1 for _, t in loaded if (t.get("config") or {}).get("reference_mode"))
    head = (
        f"# {title}\n\n"
        + _count(len(loaded) - n_refs, "run")
        + (f" and {_count(n_refs, 'float64 reference')}" if n_refs else "")
        + f", {_count(len(rows), 'repetition')}, {_count(len(groups), 'configuration')}. "
        f"Every row of `{csv_path.name}` is one repetition of one run.\n\n"
    )
    text = head + "\n".join(sec for sec in sections if sec)
    with atomic_path(md_path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    with atomic_path(html_path) as tmp:
        tmp.write_text(markdown_page(text, title, base=md_path.parent), encoding="utf-8")
    with atomic_path(runs_html_path) as tmp:
        tmp.write_text(runs_html(rows, csv_path.name, title.replace("summary", "every run and repetition")),
                       encoding="utf-8")
    return {
        "rows": len(rows),
        "configurations": len(groups),
        "runs_csv": os.fspath(csv_path),
        "convergence_csv": os.fspath(conv_path) if wrote_convergence else None,
        "summary_md": os.fspath(md_path),
        "summary_html": os.fspath(html_path),
        "runs_html": os.fspath(runs_html_path),
        "plots": [os.fspath(plots_dir / p) for p in plot_names],
    }



def _count(n: int, noun: str) -> str:
    """``"1 run"``, ``"2 runs"``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _image_plots(rows: list[dict[str, Any]], plots: Path) -> dict[str, str]:
    """One image plot per problem (``image_<matrix>_<data>.png``): the first run's image (runs before the
    float64 references, by run id) that can be read, MLEM or OSEM where one ran, with the first MAP run's
    image beside it where both ran for the problem. Returns file name -> title."""
    out: dict[str, str] = {}
    problems: dict[tuple, dict[bool, list[tuple[dict[str, Any], Path]]]] = {}
    for r in sorted(rows, key=lambda r: (bool(r["reference_mode"]), r["run"])):
        image = run_image(r)
        if image is not None:
            found = problems.setdefault((r["matrix"], r["data"]), {False: [], True: []})[bool(r.get("map_algorithm"))]
            if all(image != i for _, i in found):
                found.append((r, image))
    for (matrix, data), kinds in problems.items():
        fname = f"image_{_slug(matrix)}_{_slug(data)}.png"
        first, maps = (kinds[False], kinds[True][:1]) if kinds[False] else (kinds[True], [])
        for r, image in first:
            title = f"{matrix} / {data}: {config_label(r)}"
            beside = []
            name = "reconstruction"
            if maps:
                m, m_image = maps[0]
                name = "OSEM" if (r.get("subsets") or 1) > 1 else "MLEM"
                beside = [("MAP" + map_label(m), m_image)]
                title += f"; MAP: {config_label(m)}"
            if plot_image(image, r.get("_truth"), plots / fname, title, name=name, beside=beside):
                out[fname] = f"Image: {matrix} / {data}"
                break
    return out
