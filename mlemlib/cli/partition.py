"""``mlem partition``: nnz-balanced row blocks for P GPUs (plan.json referencing the matrix; part-{k}.h5 on request)."""

from __future__ import annotations

import argparse

from mlemlib.cli._common import add_parser, add_stream_options, existing_file, positive_int


def register(sub) -> None:
    """Add the ``partition`` subcommand."""
    p = add_parser(
        sub,
        "partition",
        "Split the matrix into P nnz-balanced row blocks: write DIR/plan.json (row ranges of the "
        "matrix file, non-zero counts and offsets, imbalance; also for A^T with --transpose); nothing "
        "is copied, except DIR/part-{k}.h5 (A_k^T) with --local-transpose.",
    )
    p.add_argument("input", type=existing_file, metavar="MATRIX.h5", help="matrix container (from 'mlem convert')")
    p.add_argument(
        "-T", "--transpose", type=existing_file, default=None, metavar="TRANSPOSE.h5",
        help="its transpose (from 'mlem transpose'): plans the row blocks of A^T too (thesis layout)",
    )
    p.add_argument(
        "-L", "--local-transpose", action="store_true",
        help="also write A_k^T, the transpose of each row block, as DIR/part-{k}.h5 (one copy of A^T on "
        "disk; needs --transpose): for back projections that read a stored A_k^T in the local layout",
    )
    p.add_argument("-p", "--parts", type=positive_int, required=True, metavar="P", help="number of parts (GPUs)")
    p.add_argument("-o", "--out", required=True, metavar="DIR", help="parts directory (e.g. results/{matrix}/parts-{P})")
    add_stream_options(p, chunk_help="non-zeros per streamed row chunk of the transpose (about 16*N bytes)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Partition ``args.input``; print one line per part."""
    from mlemlib.formats import require_container
    from mlemlib.partition import partition_file

    require_container(args.input, "mlem partition")
    if args.transpose is not None:
        require_container(args.transpose, "mlem partition --transpose")
    plan = partition_file(
        args.input,
        args.transpose,
        args.parts,
        args.out,
        local_transpose=args.local_transpose,
        chunk_nnz=args.chunk_nnz,
        threads=args.threads,
    )
    t_imb = f" (A^T row blocks {plan['transpose_imbalance']:.4f})" if "transpose_imbalance" in plan else ""
    print(f"{args.out}: {plan['parts']} part(s), imbalance {plan['imbalance']:.4f}{t_imb}, {plan['disk_bytes']} bytes")
    for k, ((r0, r1), nnz) in enumerate(zip(plan["rows"], plan["nnz_per_part"])):
        extra = ""
        if "transpose_rows" in plan:
            c0, c1 = plan["transpose_rows"][k]
            extra = f", A^T rows {c0}..{c1}"
        print(f"  part {k}: rows {r0}..{r1} ({nnz} nnz from element {plan['nnz_offsets'][k]}){extra}")
    return 0
