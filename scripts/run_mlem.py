"""Rule run_mlem: one configured reconstruction, timed over its repetitions."""

import logging

from mlemlib.logs import send_to_log

send_to_log(snakemake.log[0])

import contextlib  # noqa: E402

from mlemlib.setup_times import process_age  # noqa: E402

# Python's and Snakemake's start before this script's body; reconstruct logs the first
# iteration's time since the process started and the set-up's phases (timings.json's setup)
logging.info("run_mlem: started %.1f s after its process", process_age())

from mlemlib.dist.lease import lease_gpus  # noqa: E402
from mlemlib.backends import graph_option  # noqa: E402
from mlemlib.map_metrics import reconstruct_with_metrics  # noqa: E402
from mlemlib.mlem import reconstruct  # noqa: E402
from mlemlib.problem import ModelSpec, RunSettings  # noqa: E402

run = snakemake.params.run
mlem = snakemake.params.mlem
model = ModelSpec.of_job(snakemake.input, mlem, matrix_name=snakemake.params.matrix_name,
                         data_name=snakemake.wildcards.data)
settings = RunSettings(
    mlem["iterations"],
    repetitions=mlem["repetitions"],
    checkpoint_every=mlem["checkpoint_every"],
    backend=run["backend"],
    fp=run["fp"],
    bp=run["bp"],
    secsize=run["secsize"],
    graph=graph_option(run["graph"]),
    gpus=run["gpus"],
    layout=run["layout"],
    plan=snakemake.input.get("plan"),
    chunks=snakemake.input.get("chunks"),
    threads=snakemake.threads,
)
outputs = dict(checkpoint=snakemake.params.checkpoint, timings_out=snakemake.output.timings,
               raw_out=snakemake.output.raw)
# Snakemake counts gpu resources but never says which GPUs a job gets: take
# free ones with lock files before anything initialises CUDA.
lease = lease_gpus(run["gpus"]) if run["backend"] == "cuda" else contextlib.nullcontext()
# a MAP run of a simulated measurement measures every map_metrics_every-th pass against the converged MAP
# image (input converged) into timings.json's map.metrics
converged = snakemake.input.get("converged")
with lease:
    if converged:
        result = reconstruct_with_metrics(model, settings, snakemake.output.image, converged=converged,
                                          truth=snakemake.input.truth, every=mlem["map_metrics_every"], **outputs)
    else:
        result = reconstruct(model, settings, snakemake.output.image, truth=snakemake.input.get("truth"), **outputs)
logging.info("run_mlem: wrote %s", snakemake.output.image)
