"""Rule generate_matrix: synthesise a scanner preset's system matrix (.csr4)."""

import logging
import sys

sys.stderr = open(snakemake.log[0], "w", buffering=1)
logging.basicConfig(
    stream=sys.stderr,
    level=logging.INFO,
    format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    force=True,
)

from mlemlib.scanner import generate  # noqa: E402

summary = generate(
    snakemake.params.preset, snakemake.output.matrix, threads=snakemake.threads
)
logging.info("generate_matrix: %s", summary)
