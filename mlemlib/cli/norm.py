"""``mlem norm``: column sums of the system matrix (the sensitivity image), float64."""

from __future__ import annotations

import argparse

from mlemlib.cli._common import add_parser, add_stream_options, existing_file, factor_file


def register(sub) -> None:
    """Add the ``norm`` subcommand."""
    p = add_parser(
        sub,
        "norm",
        "Compute norm_j = sum_i a_ij (float64, bit-identical for any thread count) "
        "streaming the matrix container; write norm.h5.",
    )
    p.add_argument("input", type=existing_file, metavar="MATRIX.h5", help="matrix container (from 'mlem convert')")
    p.add_argument("-o", "--out", required=True, metavar="OUT.h5", help="output file (e.g. results/{matrix}/norm.h5)")
    p.add_argument(
        "--multiplicative", type=factor_file, default=None, metavar="M",
        help="a measurement's multiplicative factors (raw float32 per LOR or FILE.h5:/dataset): also write the "
        "subsets' sensitivities weighted by them (a reordered matrix's subsets, else one)",
    )
    add_stream_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Compute the norm of ``args.input`` into ``args.out``; print a one-line summary."""
    import numpy as np

    from mlemlib.formats import require_container
    from mlemlib.norm import compute_norm

    require_container(args.input, "mlem norm")
    norm = compute_norm(args.input, args.out, threads=args.threads, chunk_nnz=args.chunk_nnz,
                        multiplicative=args.multiplicative)
    zero = int(np.count_nonzero(norm == 0))
    print(f"{args.out}: {norm.size} voxels, sum {float(norm.sum()):.9g}, {zero} with norm 0")
    return 0
