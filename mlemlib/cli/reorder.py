"""``mlem reorder``: renumber LORs (and voxels) of a matrix container for local gathers."""

from __future__ import annotations

import argparse

from mlemlib.cli._common import add_parser, add_stream_options, add_subset_options, existing_file, positive_int


def register(sub) -> None:
    """Add the ``reorder`` subcommand."""
    from mlemlib.reorder import DEFAULT_MODE, MODES

    p = add_parser(
        sub,
        "reorder",
        "Permute the rows (LORs) and optionally the columns (voxels) of a matrix container so that "
        "the gathers of both projections are local; write the permuted container with its permutations "
        "in the input's format (MLEM with it reads measurements and writes images in the user's order).",
    )
    p.add_argument("input", type=existing_file, metavar="MATRIX.h5", help="the user's matrix container (from 'mlem convert')")
    p.add_argument("-o", "--out", required=True, metavar="OUT.h5", help="reordered container (e.g. results/{matrix}/matrix.h5)")
    p.add_argument(
        "-m", "--mode", choices=MODES, default=DEFAULT_MODE, metavar="MODE",
        help=f"what to permute: {', '.join(MODES)}",
    )
    p.add_argument(
        "-p", "--perm", type=existing_file, default=None, metavar="PERM.h5",
        help="apply this permutation file instead of computing one (it must belong to MATRIX)",
    )
    p.add_argument("--perm-out", default=None, metavar="PERM.h5", help="also write the permutation alone")
    add_subset_options(p)
    add_stream_options(p, chunk_help="non-zeros per streamed row chunk")
    p.add_argument(
        "--passes", type=positive_int, default=1, metavar="P",
        help="passes over the input; the output buffer holds 1/P of the matrix (8 bytes per non-zero, 6 for "
        "the 16-bit compressed formats)",
    )
    p.add_argument(
        "--locality", action="store_true",
        help="also print the gather footprint (32-byte sectors per row) of A and A^T before and after "
        "(reads both matrices into memory)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Reorder ``args.input`` into ``args.out``; print a one-line summary."""
    from mlemlib.formats import require_container
    from mlemlib.reorder import reorder_file

    require_container(args.input, "mlem reorder")
    s = reorder_file(
        args.input, args.out, args.mode, perm=args.perm, perm_out=args.perm_out, chunk_nnz=args.chunk_nnz,
        passes=args.passes, threads=args.threads, subsets=args.subsets, subset_file=args.subset_file,
    )
    m, n = s["shape"]
    voxels = "rows and voxels" if s["voxels_permuted"] else "rows"
    print(
        f"{s['out']}: {m} x {n}, nnz {s['nnz']}, {s['format']}, {s['mode']} ({voxels} permuted"
        f"{', rows grouped into %d subsets' % s['subsets'] if s['subsets'] else ''}), "
        f"permutation {s['permutation_s']:.3f} s, stage {s['seconds'] + s['permutation_s']:.3f} s"
    )
    if args.locality:
        from mlemlib.formats.h5 import read_matrix_h5
        from mlemlib.reorder import locality

        for label, path in (("before", args.input), ("after", args.out)):
            loc = locality(read_matrix_h5(path))
            print(
                f"{label}: A {loc['A']['sectors_per_row']:.1f} sectors/row ({loc['A']['sectors_per_nnz']:.3f}/nnz), "
                f"A^T {loc['AT']['sectors_per_row']:.1f} sectors/row ({loc['AT']['sectors_per_nnz']:.3f}/nnz)"
            )
    return 0
