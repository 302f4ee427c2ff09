"""``mlem bench``: benchmarks of the CUDA kernels (``mlem bench spmv``); needs a GPU to run."""

from __future__ import annotations

import argparse

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


def register(sub) -> None:
    """Add ``bench`` with its ``spmv`` subcommand."""
    p = add_parser(sub, "bench", "Benchmark the CUDA kernels (needs CuPy and a GPU).")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    s = add_parser(
        bsub,
        "spmv",
        "Time every SpMV kernel (forward, back on the stored transpose, back without it) and whole MLEM "
        "iterations on one matrix against cuSPARSE and the measured copy bandwidth; write JSON (+ Markdown, CSV).",
    )
    s.add_argument(
        "input",
        type=existing_file,
        nargs="?",
        metavar="MATRIX.h5",
        help="matrix (.h5, .csr4, .mtx, .npz); leave out with --synthetic",
    )
    s.add_argument(
        "-T",
        "--transpose",
        type=existing_file,
        default=None,
        metavar="T.h5",
        help="stored transpose (default: transposed on the GPU with cuSPARSE)",
    )
    s.add_argument(
        "--synthetic",
        type=_synthetic,
        default=None,
        metavar="NX,NY,NZ,ANGLES,OFFSETS",
        help="generate a tube-of-response matrix on the GPU instead of reading one "
        "(140,140,40,192,180: 1,347,840 x 784,000, 8.0e8 nnz)",
    )
    s.add_argument("-n", "--repeat", type=positive_int, default=50, metavar="N", help="timed runs per kernel")
    s.add_argument("-w", "--warmup", type=positive_int, default=5, metavar="N", help="untimed runs per kernel first")
    s.add_argument(
        "-s", "--secsize", type=_int_list, default=[5], metavar="S[,S...]", help="section size(s) of the merge kernel"
    )
    s.add_argument(
        "-l",
        "--lanes",
        type=_int_list,
        default=None,
        metavar="L[,L...]",
        help="extra lane counts of csr_vector to time besides the automatic choice",
    )
    s.add_argument(
        "--formats",
        default="csr",
        metavar="F[,F...]",
        help="matrix formats the MLEM iterations run in (csr, compressed, compressed-f16, compressed-u16; default csr): the "
        "matrix is re-encoded on the host, and each iteration is reported with its bytes per non-zero, its own "
        "floor, the CSR floor and its image's distance to the float32 CSR pair's",
    )
    s.add_argument("--no-check", action="store_true", help="skip the float64 check of every output")
    s.add_argument("-d", "--device", type=int, default=0, metavar="I", help="CUDA device index")
    s.add_argument("-o", "--out", required=True, metavar="BENCH.json", help="JSON report")
    s.add_argument("-m", "--markdown", default=None, metavar="BENCH.md", help="Markdown report")
    s.add_argument("-c", "--csv", default=None, metavar="BENCH.csv", help="CSV table of the kernels")
    s.set_defaults(func=run_spmv)


def run_spmv(args: argparse.Namespace) -> int:
    """Run :func:`mlemlib.bench.bench_spmv` with the parsed options; print the Markdown report."""
    from mlemlib.bench import bench_spmv, format_markdown, tor_matrix
    from mlemlib.errors import ConfigError

    if (args.input is None) == (args.synthetic is None):
        raise ConfigError("mlem bench spmv", "give either MATRIX or --synthetic, not both or neither")
    if args.lanes and any(k not in (2, 4, 8, 16, 32) for k in args.lanes):
        raise ConfigError("--lanes", f"lane counts must be among 2, 4, 8, 16, 32, got {args.lanes}")
    from mlemlib.bench import check_formats

    formats = check_formats([f.strip() for f in args.formats.split(",") if f.strip()])
    matrix = args.input
    label = None
    if args.synthetic is not None:
        from mlemlib.backends import _cuda_kernels as ck

        cp = ck.cupy()
        with cp.cuda.Device(args.device):
            matrix = tor_matrix(*args.synthetic, device=True)
        label = "synthetic TOR " + ",".join(str(v) for v in args.synthetic) + " (sinogram order)"
    result = bench_spmv(
        matrix,
        args.transpose,
        repeat=args.repeat,
        warmup=args.warmup,
        secsizes=args.secsize,
        formats=formats,
        lanes=args.lanes,
        check=not args.no_check,
        device=args.device,
        matrix_label=label,
        out_json=args.out,
        out_md=args.markdown,
        out_csv=args.csv,
    )
    print(format_markdown(result))
    return 0
