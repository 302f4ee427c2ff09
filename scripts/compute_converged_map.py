"""Rule compute_converged_map: the converged MAP image of one simulated measurement (BSREM, float64)."""

import logging

from mlemlib.logs import send_to_log

send_to_log(snakemake.log[0])

from mlemlib.map import MapSettings  # noqa: E402
from mlemlib.map_metrics import converged_map  # noqa: E402

mlem = snakemake.params.mlem

image, attrs = converged_map(
    snakemake.input.matrix,
    snakemake.input.sino,
    snakemake.output.image,
    map_settings=MapSettings(**mlem["map"]),
    passes=mlem["passes"],
    subsets=mlem["subsets"],
    subset_file=snakemake.input.get("subset_file"),
    multiplicative=mlem["factors"].get("multiplicative"),
    additive=mlem["factors"].get("additive"),
    norm=snakemake.input.norm,
    threads=snakemake.threads,
)
logging.info("compute_converged_map: wrote %s (Phi %s after %d passes)", snakemake.output.image, attrs.get("phi"),
             mlem["passes"])
