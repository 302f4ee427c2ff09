"""Rule partition_matrix: nnz-balanced row blocks of A (and A^T) for P GPUs."""

import logging
import sys

sys.stderr = open(snakemake.log[0], "w", buffering=1)
logging.basicConfig(
    stream=sys.stderr,
    level=logging.INFO,
    format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    force=True,
)

from pathlib import Path  # noqa: E402

from mlemlib.partition import partition_file  # noqa: E402

plan = partition_file(
    snakemake.input.matrix,
    snakemake.input.transpose,
    snakemake.params.parts,
    Path(snakemake.output.plan).parent,
    threads=snakemake.threads,
)
logging.info("partition_matrix: imbalance %s", plan.get("imbalance"))
