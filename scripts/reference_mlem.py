"""Rule reference_mlem: the float64 CPU reference MLEM of one problem."""

import logging

from mlemlib.logs import send_to_log

send_to_log(snakemake.log[0])

from mlemlib.mlem import reference  # noqa: E402
from mlemlib.problem import ModelSpec, RunSettings  # noqa: E402

mlem = snakemake.params.mlem

# exact_reference_mlem has no norm (the column sums of its matrix); MAP: the float64 reference of the same algorithm
model = ModelSpec.of_job(snakemake.input, mlem, data_name=snakemake.wildcards.data)
result = reference(
    model,
    RunSettings(mlem["iterations"], checkpoint_every=0, threads=snakemake.threads),
    snakemake.output.image,
    truth=snakemake.input.get("truth"),
    timings_out=snakemake.output.timings,
)
logging.info("reference_mlem: wrote %s", snakemake.output.image)
