"""``mlem bench``: the benchmark runner over named cases (``run``, ``prepare``), the page of its results
(``page``), and the per-kernel benchmark of one matrix (``spmv``, needs a GPU)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from mlemlib.cli._common import add_parser, existing_file, positive_int


def _int_list(text: str) -> list[int]:
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def _synthetic(text: str) -> tuple[int, int, int, int, int]:
    parts = _int_list(text)
    if len(parts) != 5:
        raise argparse.ArgumentTypeError(f"expected NX,NY,NZ,ANGLES,OFFSETS, got {text!r}")
    return tuple(parts)  # type: ignore[return-value]


def _command() -> str:
    return "mlem " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:] else "mlem bench"


def _add_case_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("cases", type=existing_file, metavar="CASES.yaml", help="the cases file (perf/cases.yaml)")
    p.add_argument("-k", "--case", action="append", default=[], metavar="NAME",
                   help="run only this case (repeatable; default: every case)")
    p.add_argument("-w", "--work", type=Path, default=None, metavar="DIR",
                   help="prepared matrices, cached by their settings (default: resources/bench)")
    p.add_argument("-t", "--threads", type=positive_int, default=None, metavar="N",
                   help="CPU threads of the preparing stages (None: all cores)")


def register(sub) -> None:
    """Add ``bench`` with its ``run``, ``prepare``, ``page`` and ``spmv`` subcommands."""
    p = add_parser(sub, "bench", "Benchmarks: named cases through the public API, and the page of their results.")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)

    r = add_parser(bsub, "run", "Run the cases of a cases file (every kernel pair on every GPU count, and every "
                   "subset count and factor setting a case lists) and merge one row per case, pair, GPU count, S and "
                   "factors into DIR/results.csv and DIR/results.json.")
    _add_case_options(r)
    r.add_argument("-g", "--gpus", type=_int_list, default=None, metavar="N[,N...]",
                   help="run only these GPU counts of each case (default: every count the case lists)")
    r.add_argument("-o", "--out", type=Path, required=True, metavar="DIR", help="results directory")
    r.add_argument("--device-kind", default=None, metavar="TEXT",
                   help="the device's name in the tables (default: '<GPUs visible> x <GPU name>')")
    r.set_defaults(func=run_cases)

    pr = add_parser(bsub, "prepare", "Prepare (and cache) the matrices of the cases (one per subset count S, their "
                    "synthetic factors and, for a case with a threshold, its simulated measurement) without timing "
                    "anything.")
    _add_case_options(pr)
    pr.set_defaults(func=prepare_cases)

    pg = add_parser(bsub, "page", "Generate the performance page (one table per device and case) from results.")
    pg.add_argument("results", nargs="+", type=existing_file, metavar="DIR", help="results directories of mlem bench run")
    pg.add_argument("-o", "--out", type=Path, default=Path("docs/performance.md"), metavar="FILE", help="the page")
    pg.add_argument("-p", "--peers", type=existing_file, default=None, metavar="PEERS.yaml",
                    help="published figures shown beside ours (default: perf/peers.yaml where it exists)")
    pg.set_defaults(func=run_page)

    s = add_parser(
        bsub,
        "spmv",
        "Time every projection kernel (forward, back on the stored transpose, back without it) and whole MLEM "
        "iterations on one matrix against cuSPARSE and the measured copy bandwidth; write JSON (+ Markdown, CSV).",
    )
    s.add_argument("input", type=existing_file, nargs="?", metavar="MATRIX.h5",
                   help="matrix (.h5, .csr4, .mtx, .npz); leave out with --synthetic")
    s.add_argument("-T", "--transpose", type=existing_file, default=None, metavar="T.h5",
                   help="stored transpose (default: transposed on the host with ScanTrans)")
    s.add_argument("--synthetic", type=_synthetic, default=None, metavar="NX,NY,NZ,ANGLES,OFFSETS",
                   help="a tube-of-response matrix instead of a file (140,140,40,192,180: 1,347,840 x 784,000, 8.0e8 nnz)")
    s.add_argument("-n", "--repeat", type=positive_int, default=50, metavar="N", help="timed runs per kernel")
    s.add_argument("-w", "--warmup", type=positive_int, default=5, metavar="N", help="untimed runs per kernel first")
    s.add_argument("-s", "--secsize", type=_int_list, default=[5], metavar="S[,S...]",
                   help="section size(s) of the merge kernel")
    s.add_argument("--formats", default="csr", metavar="F[,F...]",
                   help="matrix formats the MLEM iterations run in (csr, compressed, compressed-f16, compressed-u16; "
                   "default csr): the matrix is converted, and each iteration is reported with its bytes per "
                   "non-zero, its own floor, the CSR floor and its image's distance to the float32 CSR pair's")
    s.add_argument("--no-check", action="store_true", help="skip the float64 check of every output")
    s.add_argument("-d", "--device", type=int, default=0, metavar="I", help="CUDA device index")
    s.add_argument("-o", "--out", required=True, metavar="BENCH.json", help="JSON report")
    s.add_argument("-m", "--markdown", default=None, metavar="BENCH.md", help="Markdown report")
    s.add_argument("-c", "--csv", default=None, metavar="BENCH.csv", help="CSV table of the kernels")
    s.set_defaults(func=run_spmv)


def _cases(args: argparse.Namespace):
    from mlemlib.bench.cases import load_cases, select

    return select(load_cases(args.cases), args.case, str(args.cases))


def run_cases(args: argparse.Namespace) -> int:
    """``mlem bench run``: time the cases; print where the results went."""
    from mlemlib.bench.prepare import DEFAULT_WORK
    from mlemlib.bench.runner import run_cases as run

    cases = _cases(args)
    rows = run(cases, args.out, work=args.work or DEFAULT_WORK, gpus=args.gpus, threads=args.threads,
               command=_command(), device_kind=args.device_kind)
    done = sum(1 for r in rows if r.get("ms") is not None)
    print(f"{done} of {len(rows)} rows timed: {args.out / 'results.csv'}, {args.out / 'results.json'}")
    return 0


def prepare_cases(args: argparse.Namespace) -> int:
    """``mlem bench prepare``: prepare each case's matrix (one per subset count S, with its synthetic factors where
    the case lists them); print the directories."""
    from mlemlib.bench.prepare import DEFAULT_WORK
    from mlemlib.bench.runner import prepare_case

    for case in _cases(args):
        for prep in prepare_case(case, args.work or DEFAULT_WORK, threads=args.threads):
            print(f"{case.name}: {prep.directory}" + (f" (S = {prep.subsets})" if prep.subsets > 1 else ""))
    return 0


def run_page(args: argparse.Namespace) -> int:
    """``mlem bench page``: write the performance page."""
    from mlemlib.bench.page import write_page

    peers = args.peers
    if peers is None and Path("perf/peers.yaml").exists():
        peers = Path("perf/peers.yaml")
    write_page(args.results, args.out, peers=peers, command=_command())
    print(args.out)
    return 0


def run_spmv(args: argparse.Namespace) -> int:
    """Run :func:`mlemlib.bench.spmv.bench_spmv` with the parsed options; print the Markdown report."""
    from mlemlib.bench.spmv import bench_spmv, check_formats, format_markdown
    from mlemlib.bench.synthetic import tor_host
    from mlemlib.errors import ConfigError

    if (args.input is None) == (args.synthetic is None):
        raise ConfigError("mlem bench spmv", "give either MATRIX or --synthetic, not both or neither")
    formats = check_formats([f.strip() for f in args.formats.split(",") if f.strip()])
    matrix = args.input
    label = None
    if args.synthetic is not None:
        matrix = tor_host(args.synthetic)
        label = "synthetic TOR " + ",".join(str(v) for v in args.synthetic) + " (sinogram order)"
    result = bench_spmv(
        matrix,
        args.transpose,
        repeat=args.repeat,
        warmup=args.warmup,
        secsizes=args.secsize,
        formats=formats,
        check=not args.no_check,
        device=args.device,
        matrix_label=label,
        out_json=args.out,
        out_md=args.markdown,
        out_csv=args.csv,
    )
    print(format_markdown(result))
    return 0
