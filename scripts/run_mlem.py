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
from mlemlib.map import MapSettings  # noqa: E402
from mlemlib.map_metrics import reconstruct_with_metrics  # noqa: E402
from mlemlib.mlem import reconstruct  # noqa: E402

run = snakemake.params.run
mlem = snakemake.params.mlem
# Snakemake counts gpu resources but never says which GPUs a job gets: take
# free ones with lock files before anything initialises CUDA.
lease = lease_gpus(run["gpus"]) if run["backend"] == "cuda" else contextlib.nullcontext()
# MAP (mlem.prior): the settings; a MAP run of a simulated measurement measures every map_metrics_every-th
# pass against the converged MAP image (input converged) into timings.json's map.metrics
map_settings = MapSettings(**mlem["map"]) if "map" in mlem else None
converged = snakemake.input.get("converged")
with lease:
    settings = dict(
        iterations=mlem["iterations"],
        backend=run["backend"],
        fp=run["fp"],
        bp=run["bp"],
        secsize=run["secsize"],
        graph=graph_option(run["graph"]),
        gpus=run["gpus"],
        layout=run["layout"],
        norm=snakemake.input.norm,
        transpose=snakemake.input.get("transpose"),
        plan=snakemake.input.get("plan"),
        chunks=snakemake.input.get("chunks"),
        checkpoint_every=mlem["checkpoint_every"],
        checkpoint=snakemake.params.checkpoint,
        repetitions=mlem["repetitions"],
        timings_out=snakemake.output.timings,
        raw_out=snakemake.output.raw,
        threads=snakemake.threads,
        matrix_name=snakemake.params.matrix_name,
        data_name=snakemake.wildcards.data,
        subsets=mlem["subsets"],
        subset_file=snakemake.input.get("subset_file"),
        multiplicative=mlem["factors"].get("multiplicative"),
        additive=mlem["factors"].get("additive"),
        map_settings=map_settings,
    )
    if converged:
        result = reconstruct_with_metrics(snakemake.input.matrix, snakemake.input.sino, snakemake.output.image,
                                          converged=converged, truth=snakemake.input.truth,
                                          every=mlem["map_metrics_every"], **settings)
    else:
        result = reconstruct(snakemake.input.matrix, snakemake.input.sino, snakemake.output.image,
                             truth=snakemake.input.get("truth"), **settings)
logging.info("run_mlem: wrote %s", snakemake.output.image)
