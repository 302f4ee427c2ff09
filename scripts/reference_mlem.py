"""Rule reference_mlem: the float64 CPU reference MLEM of one problem."""

import logging

from mlemlib.logs import send_to_log

send_to_log(snakemake.log[0])

from mlemlib.mlem import reference  # noqa: E402

result = reference(
    snakemake.input.matrix,
    snakemake.input.sino,
    snakemake.output.image,
    iterations=snakemake.params.mlem["iterations"],
    norm=snakemake.input.get("norm"),  # exact_reference_mlem: none, the column sums of its matrix
    truth=snakemake.input.get("truth"),
    timings_out=snakemake.output.timings,
    threads=snakemake.threads,
    data_name=snakemake.wildcards.data,
)
logging.info("reference_mlem: wrote %s", snakemake.output.image)
