"""Rule compute_norm: column sums of A (float64-accumulated) into norm.h5."""

import logging
import sys

sys.stderr = open(snakemake.log[0], "w", buffering=1)
logging.basicConfig(
    stream=sys.stderr,
    level=logging.INFO,
    format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    force=True,
)

from mlemlib.norm import compute_norm  # noqa: E402

compute_norm(snakemake.input.matrix, snakemake.output.norm, threads=snakemake.threads)
