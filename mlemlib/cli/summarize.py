"""``mlem summarize``: runs.csv, summary.md, summary.html, runs.html and plots/ of many runs."""

from __future__ import annotations

import argparse

from mlemlib.cli._common import add_parser, existing_file


def register(sub) -> None:
    """Add the ``summarize`` subcommand."""
    p = add_parser(
        sub,
        "summarize",
        "Tabulate and plot runs: runs.csv (one row per run and repetition), summary.md (time per step, "
        "scaling over GPUs: speed-up, parallel efficiency and bandwidth per GPU of each layout, accuracy "
        "spread, transposition times, the SpMV benchmark in ms, the plots), the same two as summary.html "
        "(with the plots embedded) and runs.html, plots/*.png (plots/scaling.png where runs differ in GPU count).",
    )
    p.add_argument("runs", nargs="+", type=existing_file, metavar="RUN", help="run directories (searched for timings.json) or timings.json files")
    p.add_argument("-o", "--out", required=True, metavar="DIR", help="output directory (e.g. results/summary/manual)")
    p.add_argument("-n", "--name", metavar="NAME", help="name of the configuration, shown in the titles (default: none)")
    p.add_argument("--transpose-bench", nargs="*", default=[], type=existing_file, metavar="TSV", help="Snakemake benchmark files of transpositions")
    p.add_argument("--transposes", nargs="*", default=[], type=existing_file, metavar="T.h5", help="transpose.h5 files (method, seconds)")
    p.add_argument("--plans", nargs="*", default=[], type=existing_file, metavar="PLAN", help="partition plan.json files or directories")
    p.add_argument("--bench", nargs="*", default=[], type=existing_file, metavar="CSV", help="SpMV benchmark tables (results/{matrix}/bench/spmv.csv)")
    p.add_argument("--convergence", nargs="*", default=[], type=existing_file, metavar="JSON",
                   help="records of mlem convergence (their table, convergence.csv, and plots)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Write the summary; print where."""
    from mlemlib.report import summarize

    r = summarize(
        args.runs, args.out, transpose_benchmarks=args.transpose_bench, transposes=args.transposes,
        plans=args.plans, bench=args.bench, convergence=args.convergence, name=args.name,
    )
    print(f"{r['summary_md']}: {r['rows']} rows, {r['configurations']} configurations, {len(r['plots'])} plots")
    return 0
