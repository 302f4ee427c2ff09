"""Rule reorder_matrix: renumber LORs (and voxels) of the user's matrix into matrix.h5, rows grouped by subset."""

import logging

from mlemlib.logs import send_to_log

send_to_log(snakemake.log[0])

from mlemlib.reorder import reorder_file  # noqa: E402

summary = reorder_file(
    snakemake.input.matrix,
    snakemake.output.matrix,
    snakemake.params.mode,
    threads=snakemake.threads,
    subsets=snakemake.params.subsets,
    subset_file=snakemake.input.get("subset_file"),
)
logging.info("reorder_matrix: %s", summary)
