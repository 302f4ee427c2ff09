"""Rule convert_matrix: validate any supported matrix file into matrix.h5."""

import logging

from mlemlib.logs import send_to_log

send_to_log(snakemake.log[0])

from mlemlib.formats import convert  # noqa: E402

summary = convert(
    snakemake.input.source, snakemake.output.matrix, fmt=snakemake.params.format, fold=snakemake.params.fold
)
logging.info("convert_matrix: %s", summary)
