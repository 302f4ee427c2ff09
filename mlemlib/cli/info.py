"""``mlem info``: header, shape, nnz, geometry and validation verdict of any supported file."""

from __future__ import annotations

import argparse
import json

from mlemlib.cli._common import add_parser, existing_file
from mlemlib.errors import ConfigError


def register(sub) -> None:
    """Add the ``info`` subcommand."""
    p = add_parser(
        sub,
        "info",
        "Describe and validate a file (.csr4, .h5, .mtx, .npz, .LMsino); exit 2 naming the fault if it is bad.",
    )
    p.add_argument("file", type=existing_file, metavar="FILE", help="file to describe")
    p.add_argument("-j", "--json", action="store_true", help="print the description as JSON")
    p.add_argument(
        "-q",
        "--quick",
        action="store_true",
        help="check only the header and row pointer, not every element (large files)",
    )
    p.add_argument(
        "-m",
        "--matrix",
        type=existing_file,
        metavar="MATRIX",
        help="for a measurement: the matrix whose row count its length must equal",
    )
    p.add_argument(
        "--chunks",
        action="store_true",
        help="for a matrix: the voxel reuse of its row chunks, sampled (bp=auto without a transpose runs "
        "onepass_chunked from 8 up; a lower value in a scanner's own order asks for mlem reorder)",
    )
    p.set_defaults(func=run)


def format_info(d: dict) -> str:
    """Render :func:`mlemlib.formats.info`'s dict as readable lines."""
    lines = [f"{d['path']}: {d['kind']}, {d['bytes']:,} bytes"]
    if d["kind"] == "lmsino":
        lines.append(f"  length       {d['length']:,} LORs")
        lines.append(f"  counts       total {d['total_counts']:,}, max {d['max_count']:,}, zeros {d['zero_counts']:,}")
    else:
        m, n = d["shape"]
        if "format" in d:
            lines.append(f"  format       {d['format']}")
        lines.append(f"  shape        {m:,} x {n:,}")
        if d.get("fold"):
            fd = d["fold"]
            lines.append(f"  folded       {fd['stored_rows']:,} stored rows hold the {fd['user_rows']:,} LORs "
                         f"(method {fd['method']}; measurements have {fd['user_rows']:,} values)")
        lines.append(f"  nnz          {d['nnz']:,} (density {d['density']:.3g})")
        lines.append(
            f"  row nnz      min {d['row_nnz_min']:,}, mean {d['row_nnz_mean']:.1f}, max {d['row_nnz_max']:,}; "
            f"{d['empty_rows']:,} empty rows"
        )
        if "bytes_per_nnz" in d:
            bpn = d["bytes_per_nnz"]
            lines.append(f"  bytes per non-zero: {bpn:.3f}" if bpn is not None else "  bytes per non-zero: n/a")
            lines.append(f"  lossless: {'yes' if d['lossless'] else 'no'}")
        if d.get("chunk_reuse_sample") is not None:
            lines.append(
                f"  chunk reuse  {d['chunk_reuse_sample']:.2f} per voxel (rows in stored order, a sample block; "
                f"onepass_chunked pays off from {d['chunk_reuse_min']:g}), about {d['chunks_estimated']:,.0f} chunks "
                f"(auto takes it over the pair from {d['chunk_waves_min']} per multiprocessor)"
            )
        if d.get("grid"):
            gx, gy, gz = d["grid"]
            lines.append(f"  grid         {gx} x {gy} x {gz}")
        if d.get("voxel_size"):
            lines.append("  voxel size   " + " x ".join(f"{v:g}" for v in d["voxel_size"]) + " mm")
        if "scanner" in d:
            sc = d["scanner"]
            lines.append(
                f"  scanner      {len(sc['layers'])} layer(s), {sc['n_blocks']} blocks x {sc['block_size']} crystals, "
                f"{sc['n_rings']} rings; flags {d['flags']:#04x}"
            )
        if "attrs" in d:
            shown = {
                k: v
                for k, v in d["attrs"].items()
                if k not in ("shape", "nnz", "format", "version", "grid", "voxel_size", "encoding")
            }
            for k, v in sorted(shown.items()):
                lines.append(f"  attr {k:<12} {v}")
    lines.append(f"  verdict      {d['verdict']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Print the description of ``args.file``."""
    from mlemlib.formats import file_kind, info, open_matrix

    expected = None
    if args.matrix is not None:
        from mlemlib.fold import user_rows

        with open_matrix(args.matrix) as mat:
            expected = user_rows(mat)  # a folded matrix's measurement has the user's rows
    if file_kind(args.file) != "lmsino" and expected is not None:
        raise ConfigError("--matrix", "applies to measurement files (.LMsino) only")
    d = info(args.file, full=not args.quick, expected_length=expected)
    if d["kind"] == "h5":
        from mlemlib.fold import fold_of

        row_fold = fold_of(args.file)  # validated: a broken map is refused here
        if row_fold is not None:
            d["fold"] = {"user_rows": row_fold.m_user, "stored_rows": d["shape"][0], "method": row_fold.method}
            d["verdict"] += ", row fold"
    if args.chunks:
        if d["kind"] == "lmsino":
            raise ConfigError("--chunks", "applies to matrices only")
        from mlemlib import chunked, registry

        with open_matrix(args.file) as mat:
            sample = chunked.sample_chunks(mat)
        d["chunk_reuse_sample"], d["chunks_estimated"] = sample if sample is not None else (None, None)
        d["chunk_reuse_min"] = registry.CHUNK_REUSE_MIN
        d["chunk_waves_min"] = registry.CHUNK_WAVES_MIN
    print(json.dumps(d, indent=2) if args.json else format_info(d))
    return 0
