"""Rules transpose_matrix and compare_transpose: write A^T with one method."""

import logging

from mlemlib.logs import send_to_log

send_to_log(snakemake.log[0])

from mlemlib.transpose import transpose_file  # noqa: E402

summary = transpose_file(
    snakemake.input.matrix,
    snakemake.output.transpose,
    snakemake.params.method,
    threads=snakemake.threads,
)
logging.info("transpose_matrix: %s", summary)
