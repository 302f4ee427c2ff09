"""Summary of many runs: ``runs.csv``, Markdown and HTML tables, PNG plots (host; csv, matplotlib Agg, Python-Markdown).

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
    At a glance (each configuration's time per iteration, rel. L2 to the
    reference, whether deterministic, speed-up; wide tables show their key
    columns, then every column after an "In full:" paragraph, which the
    HTML page folds behind a click), time per iteration by step (as the thesis's Table 9.3; with the format,
    bytes per non-zero and, where measured, energy per iteration), the
    scaling over GPU counts and layouts (speed-up, parallel efficiency,
    bandwidth per GPU; only where a cuda configuration ran on more than one
    GPU count), the thesis beside us (only where a run's matrix has the shape
    of a thesis matrix, :mod:`mlemlib.thesis`: the thesis's run and each of
    our configurations, speed-up over the thesis, the ratio of aggregate
    theoretical memory bandwidths and the speed-up beyond it), the
    spread of the accuracy over repetitions, transposition times by method
    (the transposition alone and the whole job, side by side), partition
    balance, the SpMV benchmark (ms, each kernel named, the fastest and
    ``auto``'s choice marked), and the plots.
``summary.html``, ``runs.html``
    The same two as HTML pages, for the Snakemake report (whose viewer
    shows HTML and images, but offers CSV and Markdown only as links that
    open blank); ``summary.html`` embeds the plots.
``plots/time_per_iteration.png``
    Mean time per iteration of each configuration, stacked by step, with
    each repetition's mean as a circle; configurations more than 20x apart
    in separate panels; legend outside the axes, a key to the configuration
    labels below.
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
    Speed-up against the number of GPUs, one line (and colour) per
    configuration and layout, with the ideal speed-up (y = P). Written only when some cuda
    configuration has a 1-GPU run and a run on more GPUs; the workflow
    declares ``plots/`` as a directory, so a missing file is no error.
``plots/time_vs_gpus.png``
    Time per iteration (ms) against the number of GPUs, one line per
    configuration and layout through the means over repetitions, each
    repetition's mean a circle, and a star for the thesis's run where a
    run's matrix has a thesis matrix's shape. Written where a cuda run is.
``plots/image_<matrix>_<data>.png``
    Central slices (axial, coronal, sagittal) of a reconstruction beside the
    truth, one per problem: axes in mm, one grey scale for both, its units;
    where MLEM or OSEM and MAP both ran for the problem, the MAP image in a
    row below OSEM's.
``plots/map_objective.png``
    Phi, the log-likelihood and the prior R per pass of every MAP
    configuration (``map.history`` of ``timings.json``). Written only where a
    MAP run is.
``plots/map_metrics.png``
    The convergence metrics per pass (:mod:`mlemlib.map_metrics`: the RMSE
    over the phantom's object and background, the largest sphere error,
    against a converged MAP image) on log axes with the 1% and 0.5%
    thresholds. Written only where a MAP run recorded them (``map.metrics``).

The file names are stable; the workflow's report captions refer to them
(``report/plots.rst`` shows whichever of them exist).

The package has one module per concern: :mod:`~mlemlib.report.rows` (the
records), :mod:`~mlemlib.report.tables` (CSV and Markdown),
:mod:`~mlemlib.report.plots` (matplotlib), :mod:`~mlemlib.report.html`
(Python-Markdown) and :mod:`~mlemlib.report.summary` (:func:`summarize`,
which writes them all). The names below are re-exported here.
"""


from __future__ import annotations

from mlemlib.report.html import markdown_page, runs_html
from mlemlib.report.plots import (
    accuracy_baselines,
    distribution_limits,
    plot_accuracy,
    plot_distribution,
    plot_image,
    plot_map_metrics,
    plot_map_objective,
    plot_scaling,
    plot_time_vs_gpus,
    plot_times,
    scaling_series,
    time_panels,
    time_vs_gpus_series,
)
from mlemlib.report.rows import (
    RUN_COLUMNS,
    STEPS,
    config_label,
    kernel_label,
    label_terms,
    scaling_label,
    csr_pair_bytes,
    exact_reference_problem,
    floor_fractions,
    gpu_bandwidth_sum,
    group_rows,
    load_timings,
    read_benchmark_tsv,
    run_columns,
    run_gpus,
    run_image,
    run_rows,
    scaling_table,
    thesis_table,
    transpose_rows,
)
from mlemlib.report.summary import summarize
from mlemlib.report.tables import (
    SPMV_INTRO,
    THESIS_INTRO,
    TRANSPOSE_INTRO,
    accuracy_section,
    lossy_section,
    overview_section,
    plan_section,
    plots_section,
    scaling_section,
    spmv_section,
    thesis_section,
    timing_section,
    transpose_section,
    write_runs_csv,
)

__all__ = [
    "RUN_COLUMNS",
    "SPMV_INTRO",
    "STEPS",
    "THESIS_INTRO",
    "TRANSPOSE_INTRO",
    "accuracy_baselines",
    "accuracy_section",
    "config_label",
    "csr_pair_bytes",
    "distribution_limits",
    "exact_reference_problem",
    "floor_fractions",
    "gpu_bandwidth_sum",
    "group_rows",
    "kernel_label",
    "label_terms",
    "load_timings",
    "lossy_section",
    "map_columns",
    "map_label",
    "map_section",
    "map_threshold",
    "markdown_page",
    "overview_section",
    "plan_section",
    "plot_accuracy",
    "plot_distribution",
    "plot_image",
    "plot_map_metrics",
    "plot_map_objective",
    "plot_scaling",
    "plot_time_vs_gpus",
    "plot_times",
    "plots_section",
    "read_benchmark_tsv",
    "run_columns",
    "run_gpus",
    "run_image",
    "run_rows",
    "runs_html",
    "scaling_label",
    "scaling_section",
    "scaling_series",
    "scaling_table",
    "spmv_section",
    "summarize",
    "thesis_section",
    "thesis_table",
    "time_panels",
    "time_vs_gpus_series",
    "timing_section",
    "transpose_rows",
    "transpose_section",
    "write_runs_csv",
]
