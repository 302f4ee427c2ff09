"""``mlem generate``: trace a synthetic PET scanner's system matrix into a ``.csr4`` file or the container (CPU).

Prints a JSON summary (shape, nnz, timings) on stdout; progress goes to the log.
An ``.h5`` output is the project's container, written directly (CSR, or
``--format compressed``), so no ``.csr4`` copy is needed. With
``--estimate`` nothing is written: a strided sample of rows is traced and the
full run's nnz, file sizes and time (here and scaled to other core counts)
are extrapolated.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mlemlib.cli._common import add_parser, positive_int
from mlemlib.registry import FORMATS as MATRIX_FORMATS


def register(sub) -> None:
    """Add the ``generate`` subcommand."""
    from mlemlib.scanner.presets import PRESETS
    from mlemlib.scanner.geometry import VOXEL_ORDERS

    p = add_parser(sub, "generate", "Generate a synthetic scanner's system matrix (.csr4) by exact ray tracing.")
    p.add_argument(
        "-p", "--preset", choices=sorted(PRESETS), default="small",
        help="scanner and voxel grid: small (CI, seconds), madpet2 (thesis Matrix 2 sizes, ~1e9 nnz) or "
        "matrix3 (thesis Matrix 3 sizes, ~1.2e10 nnz, ~100 GB as CSR)",
    )  # fmt: skip
    p.add_argument(
        "-o", "--out", type=Path, metavar="FILE",
        help="output matrix, required unless --estimate: FILE.csr4, or FILE.h5 for the container written directly",
    )  # fmt: skip
    p.add_argument(
        "-f", "--format", choices=MATRIX_FORMATS, default="csr",
        help="matrix format of an .h5 output (a .csr4 is csr): csr (8 bytes per non-zero), compressed "
        "(lossless, about 5), compressed-f16 or compressed-u16 (lossy 16-bit values, about 3)",
    )  # fmt: skip
    p.add_argument(
        "-r", "--rays", type=positive_int, metavar="N", default=None,
        help="rays per tube of response, k**4 for k x k points per crystal face (1 = thin line); "
        "None: the preset's own (small 16, madpet2 81)",
    )  # fmt: skip
    p.add_argument("-t", "--threads", type=positive_int, metavar="N", default=None, help="Numba threads (None: all cores)")
    p.add_argument(
        "--max-nnz", type=positive_int, metavar="N", default=1 << 24,
        help="elements traced and written per chunk (bounds memory: 8 bytes each)",
    )  # fmt: skip
    p.add_argument(
        "--fold", action="store_true",
        help="store each line of response once (row (i, j), i < j; its twin (j, i) and the empty rows map to it): "
        "half the rows, bytes and MLEM time, the same image (.h5 only; docs/formats.md, 'Folded matrices')",
    )  # fmt: skip
    p.add_argument(
        "--voxel-order", choices=VOXEL_ORDERS, default="raster",
        help="column order: the grid's raster order, or the voxels along a 3-D Hilbert curve, stored as the "
        "container's voxel permutation (images stay in the grid's order; .h5 only; docs/formats.md)",
    )  # fmt: skip
    p.add_argument(
        "--estimate", type=positive_int, nargs="?", const=20000, default=None, metavar="ROWS",
        help="do not write: trace a sample of ROWS rows and print the estimated nnz and time",
    )  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``mlem generate``; return the exit status."""
    from mlemlib.errors import ConfigError
    from mlemlib.scanner import estimate, generate

    if args.estimate is not None:
        res = estimate(args.preset, rays=args.rays, threads=args.threads, sample=args.estimate, fmt=args.format,
                       fold=args.fold)
    else:
        if args.out is None:
            raise ConfigError("--out", "an output file is required (or use --estimate)")
        res = generate(
            args.preset, args.out, rays=args.rays, threads=args.threads, max_nnz=args.max_nnz, fmt=args.format,
            fold=args.fold, voxel_order=args.voxel_order,
        )
    print(json.dumps(res, indent=2))
    return 0
