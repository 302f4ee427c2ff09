"""Rule bench_spmv: every CUDA SpMV kernel against cuSPARSE on one matrix."""

import logging
import sys

sys.stderr = open(snakemake.log[0], "w", buffering=1)
logging.basicConfig(
    stream=sys.stderr,
    level=logging.INFO,
    format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    force=True,
)

from mlemlib.bench import bench_spmv  # noqa: E402

bench = snakemake.params.bench
bench_spmv(
    snakemake.input.matrix,
    snakemake.input.transpose,
    repeat=bench["repeats"],
    secsizes=bench["secsizes"],
    matrix_label=snakemake.params.matrix_name,
    out_csv=snakemake.output.csv,
    out_md=snakemake.output.md,
    out_json=snakemake.output.json,
)
logging.info("bench_spmv: wrote %s", snakemake.output.csv)
