"""Rule study_convergence: MLEM and OSEM per pass against the phantom, with and without m and b."""

import logging

from mlemlib.logs import send_to_log

send_to_log(snakemake.log[0])

import contextlib  # noqa: E402

from mlemlib.convergence import study  # noqa: E402
from mlemlib.dist.lease import lease_gpus  # noqa: E402

settings = snakemake.params.study
lease = lease_gpus(1) if settings["backend"] == "cuda" else contextlib.nullcontext()
with lease:
    study(
        snakemake.input.matrix,
        snakemake.input.sino,
        snakemake.input.truth,
        snakemake.output.record,
        subsets=settings["subsets"],
        iterations=settings["iterations"],
        record_every=settings["record_every"],
        ignore_corrections=settings["ignore_corrections"],
        backend=settings["backend"],
        fp=settings["fp"],
        bp=settings["bp"],
        multiplicative=snakemake.input.get("multiplicative"),
        additive=snakemake.input.get("additive"),
        threads=snakemake.threads,
        matrix_name=snakemake.params.matrix_name,
        data_name=snakemake.wildcards.data,
    )
logging.info("study_convergence: wrote %s", snakemake.output.record)
