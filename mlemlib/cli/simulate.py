"""``mlem simulate``: a measurement (.LMsino) of an analytic phantom through the system matrix."""

from __future__ import annotations

import argparse

from mlemlib.cli._common import add_parser, existing_file, positive_int


def _counts(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive count")
    return v


def register(sub) -> None:
    """Add the ``simulate`` subcommand."""
    from mlemlib.phantom import DEFAULT_COUNTS, PHANTOMS

    p = add_parser(
        sub,
        "simulate",
        "Project an analytic phantom through the system matrix and draw Poisson counts "
        "(seeded); write the .LMsino and the true image (truth.h5).",
    )
    p.add_argument("matrix", type=existing_file, metavar="MATRIX", help="system matrix with a voxel grid (.h5 or .csr4)")
    p.add_argument("-p", "--phantom", choices=PHANTOMS, default="nema", help="phantom")
    p.add_argument("-s", "--seed", type=int, default=1, metavar="N", help="seed of the Poisson draw")
    p.add_argument("--noiseless", action="store_true", help="write the rounded expectation instead of a Poisson draw")
    p.add_argument(
        "-c", "--counts", type=_counts, default=DEFAULT_COUNTS, metavar="N", help="total expected counts"
    )
    p.add_argument("--supersample", type=positive_int, default=3, metavar="K", help="K^3 samples per voxel (antialiasing)")
    p.add_argument("-o", "--out", required=True, metavar="DATA.LMsino", help="measurement to write")
    p.add_argument("-t", "--truth", metavar="TRUTH.h5", default=None, help="true image to write (HDF5)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Simulate; print a one-line summary."""
    from mlemlib.backends.cpu import passive_omp_wait

    passive_omp_wait()  # before any Numba parallel launch (the norm, the phantom projection)
    from mlemlib.phantom import simulate

    r = simulate(
        args.matrix, args.phantom, args.out, args.truth, seed=args.seed, noiseless=args.noiseless,
        counts=args.counts, supersample=args.supersample,
    )
    print(f"{args.out}: {r['phantom']}, {r['m']} LORs, {r['counts']} counts (max {r['max_count']} per LOR)")
    return 0
