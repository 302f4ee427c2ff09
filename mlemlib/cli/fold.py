"""``mlem fold``: store each distinct row of a system matrix once, with the map from the user's rows."""

from __future__ import annotations

import argparse
import json

from mlemlib.cli._common import add_parser, add_stream_options, existing_file


def register(sub) -> None:
    """Add the ``fold`` subcommand."""
    p = add_parser(
        sub,
        "fold",
        "Find the rows of a matrix that are equal (a LOR stored as (i, j) and (j, i), rows that miss the grid) "
        "and write each distinct non-empty row once, with the map from the user's rows: the same images from "
        "fewer bytes (docs/formats.md, 'Folded matrices').",
    )
    p.add_argument("input", type=existing_file, metavar="MATRIX", help="matrix (.h5 container, .csr4, .mtx, .npz)")
    p.add_argument("-o", "--out", required=True, metavar="OUT.h5", help="the folded container (the input's format)")
    add_stream_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Fold ``args.input`` into ``args.out``; print the summary as JSON."""
    from mlemlib.fold import fold_file

    print(json.dumps(fold_file(args.input, args.out, chunk_nnz=args.chunk_nnz, threads=args.threads), indent=2))
    return 0
