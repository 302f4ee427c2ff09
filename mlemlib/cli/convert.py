"""``mlem convert``: any system matrix (.csr4, .mtx, .npz, .h5) -> the HDF5 container (CSR or compressed), streaming."""

from __future__ import annotations

import argparse
import logging

from mlemlib.cli._common import add_parser, existing_file, positive_int
from mlemlib.registry import FORMATS as MATRIX_FORMATS

log = logging.getLogger(__name__)


def register(sub) -> None:
    """Add the ``convert`` subcommand."""
    p = add_parser(
        sub,
        "convert",
        "Convert a system matrix (.csr4, .mtx, .npz, .h5) into the validated HDF5 container, "
        "streaming row blocks; nothing is written if the input is faulty.",
    )
    p.add_argument("input", type=existing_file, metavar="INPUT", help="matrix file (.csr4, .mtx, .mtx.gz, .npz, .h5)")
    p.add_argument(
        "-o", "--out", required=True, metavar="OUT.h5", help="output container (e.g. results/{matrix}/matrix.h5)"
    )
    p.add_argument(
        "-c",
        "--chunk-nnz",
        type=positive_int,
        default=1 << 26,
        metavar="N",
        help="elements per streamed row block (peak memory is about 8*N bytes)",
    )
    p.add_argument(
        "-f",
        "--format",
        choices=MATRIX_FORMATS,
        default=None,
        help="matrix format of the container (default: an .h5 input's own format, with a compressed one's stored "
        "values kept bit for bit; csr for any other input): csr (8 bytes per non-zero), compressed (lossless, about 5: "
        "8- or 16-bit column deltas, exact float32 values), compressed-f16 (lossy float16 values, about 3) or "
        "compressed-u16 (lossy per-row 16-bit fixed point, about 3; 14-50x closer to the float32 image than f16)",
    )
    p.add_argument(
        "--code-bits",
        type=int,
        choices=(8, 16),
        default=None,
        help="compressed formats: width of the column-delta codes (default: the smaller encoding of a sample "
        "of rows spread over the input: 8 for rows of A, 16 for rows of a large scanner's A^T)",
    )
    p.add_argument(
        "--fold", action="store_true",
        help="store each distinct non-empty row once, with the map from the input's rows (a LOR stored as (i, j) "
        "and (j, i) once): the same images from fewer bytes (docs/formats.md, 'Folded matrices')",
    )  # fmt: skip
    p.add_argument(
        "--grid", nargs=3, type=positive_int, default=None, metavar=("NX", "NY", "NZ"),
        help="record the image grid of a matrix that has none (.npz, .mtx), x fastest: NX*NY*NZ must be the "
        "column count (a prior needs the grid; docs/reconstruction.md, 'MAP reconstruction')",
    )  # fmt: skip
    p.add_argument(
        "--voxel-size", nargs=3, type=float, default=None, metavar=("X", "Y", "Z"),
        help="record the voxel size in mm with --grid",
    )  # fmt: skip
    p.add_argument(
        "--clip-negative", action="store_true",
        help="set values below zero to 0 (kept as explicit zeros) and log how many and the smallest; without it "
        "a negative value is refused (a projector's export may hold a few tiny ones; docs/formats.md)",
    )  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Convert ``args.input`` to ``args.out``; print a one-line summary."""
    grid, voxel_size = getattr(args, "grid", None), getattr(args, "voxel_size", None)
    if args.fold and (grid or voxel_size):
        from mlemlib.errors import ConfigError

        raise ConfigError("--grid", "not with --fold: convert with --grid first, then fold the container "
                          "(the grid is kept)")
    clip = getattr(args, "clip_negative", False)
    if args.fold:
        from mlemlib.fold import convert_stage

        s = convert_stage(args.input, args.out, fmt=args.format, fold=True, clip_negative=clip,
                          code_bits=args.code_bits, max_nnz=args.chunk_nnz)
    else:
        from mlemlib.formats import convert

        s = convert(args.input, args.out, fmt=args.format, code_bits=args.code_bits, max_nnz=args.chunk_nnz,
                    grid=grid, voxel_size=voxel_size, clip_negative=clip)
    m, n = s["shape"]
    bpn = f"{s['bytes_per_nnz']:.2f}" if s["bytes_per_nnz"] is not None else "n/a"
    codes = f", {s['code_bits']}-bit codes" if s.get("code_bits") else ""
    print(
        f"{s['output']}: {m} x {n}, nnz {s['nnz']}, {s['format']} ({bpn} bytes per non-zero{codes}), "
        f"{s['chunks']} chunk(s), {s['bytes'] / 1e6:.1f} MB in {s['seconds']:.1f} s, checksum {s['checksum'][:16]}..."
        + (f", {s['clipped']} negative value(s) set to 0 (smallest {s['clipped_min']:.3g})" if s.get("clipped") else "")
    )
    return 0
