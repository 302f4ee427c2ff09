"""``mlem transpose``: write the transposed system matrix (ScanTrans, SciPy or cuSPARSE)."""

from __future__ import annotations

import argparse

from mlemlib.cli._common import add_parser, add_stream_options, existing_file


def register(sub) -> None:
    """Add the ``transpose`` subcommand."""
    from mlemlib.transpose import METHODS

    p = add_parser(
        sub,
        "transpose",
        "Transpose a matrix container into transpose.h5: A^T with exactly the values A decodes to, in the "
        "matrix's format (a lossy compressed-f16 or -u16 matrix's in the lossless compressed format), rows "
        "sorted; scantrans streams the input and holds one copy of the matrix.",
    )
    p.add_argument("input", type=existing_file, metavar="MATRIX.h5", help="matrix container (from 'mlem convert')")
    p.add_argument("-o", "--out", required=True, metavar="OUT.h5", help="output container (e.g. results/{matrix}/transpose.h5)")
    p.add_argument(
        "-m", "--method", choices=METHODS, default="scantrans", metavar="METHOD",
        help=f"transposition method: {', '.join(METHODS)} (cusparse needs CuPy and a GPU)",
    )
    add_stream_options(
        p,
        chunk_help="non-zeros per streamed row chunk (scantrans: about 12*N bytes besides the output)",
        threads_help="CPU threads for scantrans (None: all cores)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Transpose ``args.input`` into ``args.out``; print a one-line summary."""
    from mlemlib.formats import require_container
    from mlemlib.transpose import transpose_file

    require_container(args.input, "mlem transpose")
    s = transpose_file(args.input, args.out, args.method, threads=args.threads, chunk_nnz=args.chunk_nnz)
    n, m = s["shape"]
    codes = f", {s['code_bits']}-bit codes" if s.get("code_bits") else ""
    print(
        f"{s['out']}: {n} x {m}, nnz {s['nnz']}, {s['format']}{codes}, {s['method']} ({s['threads']} thread(s)) "
        f"{s['seconds']:.3f} s, stage {s['seconds_total']:.3f} s"
    )
    return 0
