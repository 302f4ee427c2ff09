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
        help="matrix format of the container; an .h5 input keeps its own unless this is given, any other "
        "input gets csr (default: csr): csr (8 bytes per non-zero), compressed (lossless, about 5: "
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
    p.set_defaults(func=run)


def input_format(path) -> str:
    """The matrix format of an ``.h5`` container (``csr`` or a compressed one); ``csr`` for any other file."""
    from mlemlib.formats import file_kind
    from mlemlib.formats.h5 import MatrixH5

    if file_kind(path) != "h5":
        return "csr"
    with MatrixH5(path) as f:
        return getattr(f, "format", "csr")


def convert_keeping(src, out, *, fmt: str | None = None, code_bits: int | None = None, max_nnz: int = 1 << 26) -> dict:
    """:func:`mlemlib.formats.convert`, with the input's format by default; a compressed container converted to
    its own format is copied with its stored values bit for bit (:func:`~mlemlib.formats.compressed_h5.copy_compressed`:
    a lossy one is not rounded again)."""
    from mlemlib.formats import convert

    own = input_format(src)
    fmt = fmt or own
    if fmt != "csr" and fmt == own:
        from mlemlib.formats.compressed_h5 import copy_compressed

        return copy_compressed(src, out, code_bits=code_bits, max_nnz=max_nnz)
    return convert(src, out, max_nnz=max_nnz, fmt=fmt, code_bits=code_bits)


def run(args: argparse.Namespace) -> int:
    """Convert ``args.input`` to ``args.out``; print a one-line summary."""
    if args.fold:
        from mlemlib.fold import fold_file

        s = fold_file(args.input, args.out, fmt=args.format, code_bits=args.code_bits, chunk_nnz=args.chunk_nnz)
    else:
        s = convert_keeping(args.input, args.out, fmt=args.format, code_bits=args.code_bits, max_nnz=args.chunk_nnz)
    m, n = s["shape"]
    bpn = f"{s['bytes_per_nnz']:.2f}" if s["bytes_per_nnz"] is not None else "n/a"
    codes = f", {s['code_bits']}-bit codes" if s.get("code_bits") else ""
    print(
        f"{s['output']}: {m} x {n}, nnz {s['nnz']}, {s['format']} ({bpn} bytes per non-zero{codes}), "
        f"{s['chunks']} chunk(s), {s['bytes'] / 1e6:.1f} MB in {s['seconds']:.1f} s, checksum {s['checksum'][:16]}..."
    )
    return 0
