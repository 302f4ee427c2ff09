"""Rule compute_converged_map: the converged MAP image of one simulated measurement (BSREM, float64)."""

import logging

from mlemlib.logs import send_to_log

send_to_log(snakemake.log[0])

from mlemlib.map_metrics import converged_map  # noqa: E402
from mlemlib.problem import ModelSpec, RunSettings  # noqa: E402

mlem = snakemake.params.mlem

model = ModelSpec.of_job(snakemake.input, mlem)
image, attrs = converged_map(
    model,
    snakemake.output.image,
    passes=mlem["passes"],
    settings=RunSettings(mlem["passes"], checkpoint_every=0, threads=snakemake.threads, reference_mode=True),
)
logging.info("compute_converged_map: wrote %s (Phi %s after %d passes)", snakemake.output.image, attrs.get("phi"),
             mlem["passes"])
