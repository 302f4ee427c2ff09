"""Rule reference_mlem: the float64 CPU reference MLEM of one problem."""

import logging

from mlemlib.logs import send_to_log

send_to_log(snakemake.log[0])

from mlemlib.map import MapSettings  # noqa: E402
from mlemlib.mlem import reference  # noqa: E402
from mlemlib.problem import ModelSpec, RunSettings  # noqa: E402

mlem = snakemake.params.mlem

model = ModelSpec(
    snakemake.input.matrix,
    snakemake.input.sino,
    norm=snakemake.input.get("norm"),  # exact_reference_mlem: none, the column sums of its matrix
    subsets=mlem["subsets"],
    subset_file=snakemake.input.get("subset_file"),
    multiplicative=mlem["factors"].get("multiplicative"),
    additive=mlem["factors"].get("additive"),
    # MAP (mlem.prior): the float64 reference of the same algorithm
    map=MapSettings(**mlem["map"]) if "map" in mlem else None,
    data_name=snakemake.wildcards.data,
)
result = reference(
    model,
    RunSettings(mlem["iterations"], checkpoint_every=0, threads=snakemake.threads),
    snakemake.output.image,
    truth=snakemake.input.get("truth"),
    timings_out=snakemake.output.timings,
)
logging.info("reference_mlem: wrote %s", snakemake.output.image)
