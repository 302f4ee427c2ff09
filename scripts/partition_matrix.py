"""Rule partition_matrix: nnz-balanced row blocks of A (and A^T) for P GPUs."""

import logging

from mlemlib.logs import send_to_log

send_to_log(snakemake.log[0])

from pathlib import Path  # noqa: E402

from mlemlib.partition import partition_file  # noqa: E402

plan = partition_file(
    snakemake.input.matrix,
    snakemake.input.get("transpose"),
    snakemake.params.parts,
    Path(snakemake.output.plan).parent,
    local_transpose=snakemake.params.local_transpose,
    threads=snakemake.threads,
)
logging.info(
    "partition_matrix: imbalance %s, disk %d bytes",
    plan.get("imbalance"),
    plan["disk_bytes"],
)
