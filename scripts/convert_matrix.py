"""Rule convert_matrix: validate any supported matrix file into matrix.h5."""

import logging
import sys

sys.stderr = open(snakemake.log[0], "w", buffering=1)
logging.basicConfig(
    stream=sys.stderr,
    level=logging.INFO,
    format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    force=True,
)

from mlemlib.formats import convert  # noqa: E402

summary = convert(snakemake.input.source, snakemake.output.matrix)
logging.info("convert_matrix: %s", summary)
