"""Rule reference_mlem: the float64 CPU reference MLEM of one problem."""

import logging
import sys

sys.stderr = open(snakemake.log[0], "w", buffering=1)
logging.basicConfig(
    stream=sys.stderr,
    level=logging.INFO,
    format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    force=True,
)

from mlemlib.mlem import reference  # noqa: E402

result = reference(
    snakemake.input.matrix,
    snakemake.input.sino,
    snakemake.output.image,
    iterations=snakemake.params.mlem["iterations"],
    norm=snakemake.input.norm,
    truth=snakemake.input.get("truth"),
    timings_out=snakemake.output.timings,
    threads=snakemake.threads,
)
logging.info("reference_mlem: wrote %s", snakemake.output.image)
