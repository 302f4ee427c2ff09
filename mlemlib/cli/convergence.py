"""``mlem convergence``: MLEM and OSEM per pass against the phantom, with and without the measurement's m and b."""

from __future__ import annotations

import argparse

from mlemlib.cli._common import add_parser, existing_file, factor_file, positive_int


def register(sub) -> None:
    """Add the ``convergence`` subcommand."""
    p = add_parser(
        sub,
        "convergence",
        "Reconstruct a simulated measurement with each subset count for the same passes, recording per pass the "
        "contrast recovery and the relative error against the phantom, and the same data with m = 1, b = 0 "
        "(the bias of ignoring them); write the study's JSON record (mlem summarize --convergence tabulates it).",
    )
    p.add_argument("matrix", type=existing_file, metavar="MATRIX", help="the user's matrix container (not reordered)")
    p.add_argument("-s", "--sino", required=True, type=existing_file, metavar="DATA.LMsino", help="measurement")
    p.add_argument("-t", "--truth", required=True, type=existing_file, metavar="TRUTH.h5", help="its phantom (mlem simulate --truth)")
    p.add_argument("--subsets", type=positive_int, nargs="+", default=[1, 4, 8, 16], metavar="S",
                   help="subset counts (1: MLEM, the yardstick; default: %(default)s)")
    p.add_argument("-n", "--iterations", type=positive_int, default=50, metavar="N", help="passes per reconstruction (default: %(default)s)")
    p.add_argument("--record-every", type=positive_int, default=1, metavar="K", help="measure every K passes (default: %(default)s)")
    p.add_argument("--multiplicative", type=factor_file, default=None, metavar="M", help="the measurement's m (raw float32 per LOR or FILE.h5:/dataset)")
    p.add_argument("--additive", type=factor_file, default=None, metavar="B", help="the measurement's b")
    p.add_argument("--no-ignored", action="store_true", help="leave out the reconstructions that ignore m and b")
    p.add_argument("-b", "--backend", choices=("cpu", "cuda"), default="cpu", help="where to reconstruct (default: %(default)s)")
    p.add_argument("-o", "--out", required=True, metavar="STUDY.json", help="the record to write")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the study; print MLEM's contrast recovery and the passes each S takes to reach it."""
    from mlemlib.backends.cpu import passive_omp_wait

    from mlemlib.formats import require_container

    require_container(args.matrix, "mlem convergence")
    passive_omp_wait()  # before any Numba parallel launch
    from mlemlib.convergence import study, study_rows

    record = study(args.matrix, args.sino, args.truth, args.out, subsets=args.subsets, iterations=args.iterations,
                   record_every=args.record_every, multiplicative=args.multiplicative, additive=args.additive,
                   ignore_corrections=not args.no_ignored, backend=args.backend)
    for r in study_rows([record]):
        if r["corrections"] == "modelled":
            print(f"S = {r['subsets']}: contrast recovery {r['crc_hot']:.4f} after {r['passes']} passes, "
                  f"MLEM's reached after {r['passes_to_mlem_crc'] if r['passes_to_mlem_crc'] else '-'}")
    return 0
