"""``mlem chunk``: the row chunks of the one-GPU and N-GPU chunked one pass, built once into a file."""

from __future__ import annotations

import argparse

from mlemlib.cli._common import add_parser, existing_file, positive_int


def register(sub) -> None:
    """Add the ``chunk`` subcommand."""
    from mlemlib import chunked

    p = add_parser(
        sub,
        "chunk",
        "Group the matrix's rows, in their stored order, into chunks of at most --window distinct voxels and "
        "write them in the layout the onepass_chunked kernel reads (chunks.h5), streaming block by block; "
        "mlem reconstruct --chunks loads it instead of chunking the matrix in every run.",
    )
    p.add_argument("input", type=existing_file, metavar="MATRIX", help="matrix (.h5, .csr4, .mtx, .npz; reordered: mlem reorder)")
    p.add_argument("-o", "--out", required=True, metavar="CHUNKS.h5", help="output file (e.g. results/{matrix}/chunks.h5)")
    p.add_argument(
        "-w", "--window", type=positive_int, default=chunked.DEFAULT_WINDOW, metavar="W",
        help=f"most voxels per chunk (at most {chunked.MAX_WINDOW}; a GPU refuses more than its shared memory holds)",
    )
    p.add_argument("-t", "--threads", type=positive_int, default=None, metavar="N", help="CPU threads (None: all cores)")
    p.add_argument(
        "-c", "--chunk-nnz", type=positive_int, default=chunked.LAYOUT_BLOCK_NNZ, metavar="N",
        help="non-zeros per block built in host memory (chunks end at a block's end)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Write the layout of ``args.input`` to ``args.out``; print a one-line summary."""
    from mlemlib import chunked
    from mlemlib.errors import ConfigError, InputError

    try:
        with chunked.write_layout(args.input, args.out, args.window, max_nnz=args.chunk_nnz,
                                  threads=args.threads) as lay:
            per_nnz = lay.device_bytes() / max(lay.nnz, 1)
            print(f"{args.out}: {lay.chunks} chunks of <= {lay.window} voxels, reuse {lay.reuse:.2f}, "
                  f"{per_nnz:.3f} bytes per non-zero on a GPU (format {lay.format})")
    except ValueError as exc:  # a row longer than the window, values that are not the format's
        if isinstance(exc, InputError):  # it names its file already
            raise
        raise ConfigError(str(args.input), str(exc)) from exc
    return 0
