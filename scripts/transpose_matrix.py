"""Rules transpose_matrix and compare_transpose: write A^T with one method."""

import logging
import sys

sys.stderr = open(snakemake.log[0], "w", buffering=1)
logging.basicConfig(
    stream=sys.stderr,
    level=logging.INFO,
    format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    force=True,
)

from mlemlib.transpose import transpose_file  # noqa: E402

summary = transpose_file(
    snakemake.input.matrix,
    snakemake.output.transpose,
    snakemake.params.method,
    threads=snakemake.threads,
)
logging.info("transpose_matrix: %s", summary)
