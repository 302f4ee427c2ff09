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
    p.add_argument("matrix", type=existing_file, metavar="MATRIX", help="system matrix with a voxel grid (.h5 or .csr4; an .mtx or .npz through mlem convert --grid)")
    p.add_argument("-p", "--phantom", choices=PHANTOMS, default="nema", help="phantom")
    p.add_argument("-s", "--seed", type=int, default=1, metavar="N", help="seed of the Poisson draw")
    p.add_argument("--noiseless", action="store_true", help="write the rounded expectation instead of a Poisson draw")
    p.add_argument(
        "-c", "--counts", type=_counts, default=DEFAULT_COUNTS, metavar="N", help="total expected counts"
    )
    p.add_argument("--supersample", type=positive_int, default=3, metavar="K", help="K^3 samples per voxel (antialiasing)")
    p.add_argument("-o", "--out", required=True, metavar="DATA.LMsino", help="measurement to write")
    p.add_argument("-t", "--truth", metavar="TRUTH.h5", default=None, help="true image to write (HDF5)")
    real = p.add_argument_group("realistic data (docs/reconstruction.md, 'Simulated realistic data'; all off by default)")
    real.add_argument("--attenuation", action="store_true",
                      help="attenuate each LOR by exp(-sum A mu), the phantom's water-equivalent mu-map")
    real.add_argument("--normalisation-spread", type=_fraction, default=0.0, metavar="CV",
                      help="coefficient of variation of the crystal efficiencies (0: none)")
    real.add_argument("--normalisation-seed", type=int, default=0, metavar="N", help="seed of the efficiencies")
    real.add_argument("--randoms-fraction", type=_fraction, default=0.0, metavar="F",
                      help="expected randoms as a fraction of the expected counts")
    real.add_argument("--scatter-fraction", type=_fraction, default=0.0, metavar="F",
                      help="expected scatter as a fraction of the expected counts")
    real.add_argument("--multiplicative-out", metavar="M.f32", default=None,
                      help="where to write m (float32 per LOR); default beside --out as DATA.mult.f32 where m is not 1")
    real.add_argument("--additive-out", metavar="B.f32", default=None,
                      help="where to write b (float32 per LOR); default beside --out as DATA.add.f32 where b is not 0")
    p.set_defaults(func=run)


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"{text} is not in [0, 1)")
    return v


def run(args: argparse.Namespace) -> int:
    """Simulate; print a one-line summary."""
    from mlemlib.backends.cpu import passive_omp_wait

    from mlemlib.errors import MatrixFormatError
    from mlemlib.formats import convert_command, file_kind

    if file_kind(args.matrix) in ("mtx", "npz"):  # these formats hold no voxel grid
        raise MatrixFormatError(
            args.matrix, "has no voxel grid, which the phantom needs: make a container that records one with "
            f"'{convert_command(args.matrix, '--grid NX NY NZ --voxel-size X Y Z')}'"
        )
    passive_omp_wait()  # before any Numba parallel launch (the norm, the phantom projection)
    from mlemlib.phantom import simulate

    from pathlib import Path

    from mlemlib.phantom import ScannerEffects

    effects = ScannerEffects(attenuation=args.attenuation, normalisation_spread=args.normalisation_spread,
                             normalisation_seed=args.normalisation_seed, randoms_fraction=args.randoms_fraction,
                             scatter_fraction=args.scatter_fraction)
    stem = Path(args.out).with_suffix("")
    mult = args.multiplicative_out or (f"{stem}.mult.f32" if args.attenuation or args.normalisation_spread else None)
    add = args.additive_out or (f"{stem}.add.f32" if args.randoms_fraction or args.scatter_fraction else None)
    r = simulate(
        args.matrix, args.phantom, args.out, args.truth, seed=args.seed, noiseless=args.noiseless,
        counts=args.counts, supersample=args.supersample, effects=effects, out_multiplicative=mult, out_additive=add,
    )
    print(f"{args.out}: {r['phantom']}, {r['m']} LORs, {r['counts']} counts (max {r['max_count']} per LOR)"
          + "".join(f"; {what} {path}" for what, path in (("m", mult), ("b", add)) if path))
    return 0
