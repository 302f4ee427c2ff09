"""Rule convert_matrix: validate any supported matrix file into matrix.h5."""

import logging

from mlemlib.logs import send_to_log

send_to_log(snakemake.log[0])

from mlemlib.fold import fold_file  # noqa: E402
from mlemlib.formats import convert  # noqa: E402

# fold: each distinct row once, with the map from the user's rows (docs/formats.md); a compressed
# container kept in its own format is copied with its stored values bit for bit (convert does it)
write = fold_file if snakemake.params.fold else convert
summary = write(snakemake.input.source, snakemake.output.matrix, fmt=snakemake.params.format)
logging.info("convert_matrix: %s", summary)
