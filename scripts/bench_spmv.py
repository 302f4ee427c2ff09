"""Rule bench_spmv: every projection kernel and kernel pair on one matrix against cuSPARSE (mlemlib.bench.spmv)."""

import logging

from mlemlib.logs import send_to_log

send_to_log(snakemake.log[0])

from mlemlib.bench.spmv import bench_spmv  # noqa: E402
from mlemlib.dist.lease import lease_gpus  # noqa: E402

bench = snakemake.params.bench
with lease_gpus(1):  # the GPU Snakemake counted for this job, not one a run holds
    bench_spmv(
        snakemake.input.matrix,
        snakemake.input.get("transpose"),
        repeat=bench["repeats"],
        secsizes=bench["secsizes"],
        formats=bench["formats"],
        matrix_label=snakemake.params.matrix_name,
        out_csv=snakemake.output.csv,
        out_md=snakemake.output.md,
        out_json=snakemake.output.json,
    )
logging.info("bench_spmv: wrote %s", snakemake.output.csv)
