"""Rule generate_matrix: synthesise a scanner preset's system matrix (.csr4)."""

import logging

from mlemlib.logs import send_to_log

send_to_log(snakemake.log[0])

from mlemlib.scanner import generate  # noqa: E402

summary = generate(
    snakemake.params.preset, snakemake.output.matrix, threads=snakemake.threads
)
logging.info("generate_matrix: %s", summary)
