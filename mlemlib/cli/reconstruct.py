"""``mlem reconstruct``: MLEM with a stored system matrix on the CPU or 1..N GPUs (or the float64 reference)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from mlemlib.cli._common import add_parser, add_subset_options, existing_file, factor_file, output_file

if TYPE_CHECKING:
    from mlemlib.problem import ModelSpec, RunSettings


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{v}: must be >= {minimum}")
        return v

    return parse


def register(sub) -> None:
    """Add the ``reconstruct`` subcommand."""
    p = add_parser(
        sub,
        "reconstruct",
        "Reconstruct an image with MLEM; write the image (HDF5), image.raw (float32, no header) and "
        "timings.json beside it. A run killed after a checkpoint resumes from it when started again.",
    )
    p.add_argument("-m", "--matrix", required=True, type=existing_file, metavar="MATRIX", help="system matrix (.h5, .csr4, .mtx, .npz)")
    p.add_argument("-s", "--sino", required=True, type=existing_file, metavar="DATA.LMsino", help="measurement (int32 counts)")
    p.add_argument("-n", "--iterations", required=True, type=_int_at_least(1), metavar="N", help="MLEM iterations (>= 1)")
    p.add_argument("--norm", type=existing_file, metavar="NORM.h5", help="column sums (default: computed from the matrix)")
    p.add_argument("-t", "--transpose", type=existing_file, metavar="T.h5", help="stored A^T (default: back-project with A)")
    p.add_argument("-b", "--backend", choices=("auto", "cpu", "cuda"), default="auto", help="compute backend ($MLEM_BACKEND overrides auto)")
    p.add_argument("--fp", default="auto", metavar="KERNEL", help="forward-projection kernel (auto; mlem kernels lists the names per backend)")
    p.add_argument("--bp", default="auto", metavar="KERNEL", help="back-projection kernel (auto, notrans; mlem kernels lists the names per backend)")
    p.add_argument("--secsize", type=_int_at_least(1), default=None, metavar="K", help="section size of the merge kernel (cuda)")
    p.add_argument("-g", "--gpus", type=_int_at_least(1), default=1, metavar="P", help="number of GPUs")
    p.add_argument("--layout", choices=("local", "thesis"), default="local", help="multi-GPU communication layout")
    p.add_argument(
        "--graph", action=argparse.BooleanOptionalAction, default=None,
        help="capture each iteration (all GPUs' kernels and the all-reduce) as CUDA graphs and replay them (cuda); "
             "default: on for MLEM on several GPUs and for OSEM (--subsets) on any number, where the kernels can "
             "be captured",
    )
    p.add_argument(
        "--chunks", type=existing_file, metavar="CHUNKS.h5",
        help="the matrix's row chunks (mlem chunk): onepass_chunked loads them instead of chunking the matrix (cuda)",
    )
    add_subset_options(p)
    p.add_argument(
        "--multiplicative", type=factor_file, default=None, metavar="M",
        help="multiplicative factors m per LOR (attenuation x normalisation; raw float32 or FILE.h5:/dataset)",
    )
    p.add_argument(
        "--additive", type=factor_file, default=None, metavar="B",
        help="additive expected background b per LOR (randoms + scatter, in counts; raw float32 or FILE.h5:/dataset)",
    )
    from mlemlib.map import ALGORITHMS, AVERAGING, DEFAULT_RELAXATION, PRECONDITIONERS

    m = p.add_argument_group("MAP reconstruction (docs/reconstruction.md, 'MAP reconstruction'; each iteration a pass)")
    m.add_argument("--prior", choices=("rdp", "quadratic"), default=None,
                   help="maximise the log-likelihood minus beta times this prior: the relative difference prior or "
                        "the quadratic one (default: none, MLEM/OSEM)")
    m.add_argument("--beta", type=float, default=None, metavar="B", help="the prior's strength (>= 0; required with --prior)")
    m.add_argument("--gamma", type=float, default=2.0, metavar="G", help="rdp: edge preservation (>= 0)")
    m.add_argument("--epsilon", type=float, default=None, metavar="E",
                   help="rdp: smoothing (> 0; required for rdp: small against the image's values, e.g. 1e-3 of their mean)")
    m.add_argument("--kappa", type=factor_file, default=None, metavar="FILE",
                   help="per-voxel weights of the prior (raw float32 or FILE.h5:/dataset; default 1)")
    m.add_argument("--algorithm", choices=ALGORITHMS, default="bsrem",
                   help="bsrem (converges to the MAP image) or osl (one-step-late OSEM: fast, does not converge with subsets)")
    m.add_argument("--relaxation", type=float, nargs=2, default=DEFAULT_RELAXATION, metavar=("L0", "ETA"),
                   help="BSREM's relaxation lambda_n = L0 / (1 + n / ETA) in pass n")
    m.add_argument("--preconditioner", choices=PRECONDITIONERS, default="em",
                   help="BSREM's preconditioner: em (f / s) or hessian (f / (s + beta f H), H the prior's curvature)")
    m.add_argument("--preconditioner-offset", type=float, default=0.0, metavar="O",
                   help="f + O f0 in place of f in BSREM's preconditioner, f0 the initial image's value (>= 0; "
                        "0: none): faster in cold regions")
    m.add_argument("--averaging", choices=AVERAGING, default="last",
                   help="BSREM's image of a pass: last (its last sub-iterate) or pass (the mean of its sub-iterates: "
                        "most of the subsets' limit cycle cancels; the iteration goes on from the last)")
    m.add_argument("--subset-halving", type=int, nargs="+", default=(), metavar="P",
                   help="BSREM: after each pass P the sub-iterations per pass halve, each then covering two "
                        "neighbouring subsets (S divisible by 2 per P)")
    p.add_argument("--plan", type=existing_file, metavar="PARTS", help="partition directory or plan.json (gpus > 1)")
    p.add_argument("-k", "--checkpoint-every", type=_int_at_least(0), default=10, metavar="K", help="checkpoint every K iterations (0: never)")
    p.add_argument("--checkpoint", type=output_file, metavar="CKPT.h5", default=None, help="checkpoint file (default: <out>.checkpoint.h5)")
    p.add_argument("-r", "--repetitions", type=_int_at_least(1), default=1, metavar="R", help="timed repetitions (matrix loaded once)")
    p.add_argument("--reference", type=existing_file, metavar="REF.h5", help="float64 reference image for the relative L2 error")
    p.add_argument("--truth", type=existing_file, metavar="TRUTH.h5", help="true phantom image (from mlem simulate)")
    p.add_argument("--reference-mode", action="store_true", help="compute the float64 CPU reference instead (writes only --out)")
    p.add_argument("-j", "--threads", type=_int_at_least(1), default=None, metavar="N", help="host threads (cpu backend)")
    p.add_argument("--timings", type=output_file, metavar="TIMINGS.json", default=None, help="timings file (default: timings.json beside --out)")
    p.add_argument("--matrix-name", metavar="NAME", default=None, help="matrix name in tables (default: from its path)")
    p.add_argument("-o", "--out", required=True, type=output_file, metavar="IMAGE.h5", help="image to write (not a directory)")
    p.add_argument(
        "--lease", action="store_true",
        help="take --gpus free GPUs of this node with lock files first (concurrent jobs; see mlem lease)",
    )
    p.add_argument("--lease-timeout", type=float, default=600.0, metavar="SECONDS", help="wait at most this long for --lease")
    p.set_defaults(func=run)


def map_settings(args: argparse.Namespace) -> object | None:
    """The MAP settings of the options (None without ``--prior``); one-line refusals naming the option."""
    from mlemlib.errors import ConfigError
    from mlemlib.map import MapSettings

    if args.prior is None:
        given = [o for o, v in (("--beta", args.beta), ("--epsilon", args.epsilon), ("--kappa", args.kappa)) if v is not None]
        if given:
            raise ConfigError(given[0], "is a prior's parameter: give --prior rdp or --prior quadratic too")
        return None
    if args.beta is None:
        raise ConfigError("--beta", f"--prior {args.prior} needs the prior's strength --beta B (>= 0)")
    from mlemlib.map import check_halving

    try:
        settings = MapSettings(args.prior, beta=args.beta, gamma=args.gamma, epsilon=args.epsilon, kappa=args.kappa,
                               algorithm=args.algorithm, relaxation=tuple(args.relaxation),
                               preconditioner=args.preconditioner,
                               preconditioner_offset=args.preconditioner_offset, averaging=args.averaging,
                               subset_halving=tuple(args.subset_halving)).check()
        check_halving(settings.subset_halving, args.subsets)
        return settings
    except ConfigError as exc:  # prior.beta -> --beta
        raise ConfigError("--" + exc.source.split(".")[-1].replace("_", "-"), exc.fault) from None


def model_spec(args: argparse.Namespace) -> ModelSpec:
    """What the options say is reconstructed: a :class:`mlemlib.problem.ModelSpec`."""
    from mlemlib.problem import ModelSpec

    return ModelSpec(
        args.matrix, args.sino, norm=args.norm, transpose=args.transpose, subsets=args.subsets,
        subset_file=args.subset_file, multiplicative=args.multiplicative, additive=args.additive,
        map=map_settings(args), matrix_name=args.matrix_name,
    )


def run_settings(args: argparse.Namespace) -> RunSettings:
    """How the options say to run it: a :class:`mlemlib.problem.RunSettings`."""
    from mlemlib.problem import RunSettings

    return RunSettings(
        args.iterations, repetitions=args.repetitions, checkpoint_every=args.checkpoint_every, backend=args.backend,
        fp=args.fp, bp=args.bp, secsize=args.secsize, graph=args.graph, gpus=args.gpus, layout=args.layout,
        plan=args.plan, threads=args.threads, chunks=args.chunks, reference_mode=args.reference_mode,
    )


def run(args: argparse.Namespace) -> int:
    """Run the reconstruction; print a one-line summary."""
    import contextlib
    import math

    from mlemlib.backends.cpu import passive_omp_wait

    passive_omp_wait()  # before any Numba parallel launch (the norm, the phantom projection)
    from mlemlib.mlem import reconstruct

    model, settings = model_spec(args), run_settings(args)
    lease = contextlib.nullcontext()
    if args.lease:  # before anything initialises CUDA: the lease sets CUDA_VISIBLE_DEVICES
        from mlemlib.dist.lease import lease_gpus

        lease = lease_gpus(args.gpus, timeout=args.lease_timeout)
    with lease:
        t = reconstruct(model, settings, args.out, reference=args.reference, truth=args.truth,
                        checkpoint=args.checkpoint, timings_out=args.timings)
    last = t["repetitions"][-1]
    it = last["steps"].get("iteration", {}).get("mean")
    per_it = f"{it * 1e3:.3f} ms/iteration" if it is not None and math.isfinite(it) else "no iterations"
    print(f"{args.out}: {t['config']['backend']} {per_it}, image sum {last['accuracy']['image_sum']:.9g}"
          + _outcome(t, last))
    return 0


def _outcome(t: dict, last: dict) -> str:
    """What the last line adds where the run has it: MAP's objective Phi after the last pass and its change in that
    pass (BSREM's never decreases with the default relaxation), the image's distance from the truth."""
    hist = (t.get("map") or {}).get("history") or []
    text = ""
    if hist:
        text += f", Phi {hist[-1]['phi']:.12g}"
        if len(hist) > 1:
            text += f" ({hist[-1]['phi'] - hist[-2]['phi']:+.3g} in the last pass)"
    truth = last["accuracy"].get("rel_l2_truth")
    if truth is not None:
        text += f", {truth:.3g} from the truth (relative L2)"
    return text
