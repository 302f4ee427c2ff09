"""Rule reference_mlem: the float64 CPU reference MLEM of one problem."""

import logging

from mlemlib.logs import send_to_log

send_to_log(snakemake.log[0])

from mlemlib.map import MapSettings  # noqa: E402
from mlemlib.mlem import reference  # noqa: E402

mlem = snakemake.params.mlem

result = reference(
    snakemake.input.matrix,
    snakemake.input.sino,
    snakemake.output.image,
    iterations=mlem["iterations"],
    norm=snakemake.input.get("norm"),  # exact_reference_mlem: none, the column sums of its matrix
    truth=snakemake.input.get("truth"),
    timings_out=snakemake.output.timings,
    threads=snakemake.threads,
    data_name=snakemake.wildcards.data,
    subsets=mlem["subsets"],
    subset_file=snakemake.input.get("subset_file"),
    multiplicative=mlem["factors"].get("multiplicative"),
    additive=mlem["factors"].get("additive"),
    # MAP (mlem.prior): the float64 reference of the same algorithm
    map_settings=MapSettings(**mlem["map"]) if "map" in mlem else None,
)
logging.info("reference_mlem: wrote %s", snakemake.output.image)
