"""Rules generate_matrix and generate_container: synthesise a scanner preset's
system matrix into a .csr4, or straight into the container (csr or compressed)."""

import logging

from mlemlib.logs import send_to_log

send_to_log(snakemake.log[0])

from mlemlib.scanner import generate  # noqa: E402

summary = generate(
    snakemake.params.preset,
    snakemake.output.matrix,
    threads=snakemake.threads,
    fmt=snakemake.params.format,
    fold=snakemake.params.fold,
    voxel_order=getattr(snakemake.params, "voxel_order", "raster"),
)
logging.info("generate_matrix: %s", summary)
