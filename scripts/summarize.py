"""Rule summarize: runs.csv, summary.md (and as HTML) and plots of every run."""

import logging

from mlemlib.logs import send_to_log

send_to_log(snakemake.log[0])

from mlemlib.report import summarize  # noqa: E402

summary = summarize(
    timings=snakemake.input.timings,
    references=snakemake.input.references,
    exact_references=snakemake.input.exact_references,
    plans=snakemake.input.plans,
    transposes=snakemake.input.transposes,
    transpose_benchmarks=snakemake.input.transpose_benchmarks,
    bench=snakemake.input.bench,
    convergence=snakemake.input.convergence,
    out_csv=snakemake.output.runs,
    out_convergence=snakemake.output.convergence or None,  # none without the study
    out_md=snakemake.output.summary,
    out_plots=snakemake.output.plots,
    out_html=snakemake.output.summary_html,
    out_runs_html=snakemake.output.runs_html,
    name=snakemake.params.name,
)
logging.info("summarize: %s", summary)
