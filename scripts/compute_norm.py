"""Rules compute_norm and compute_measurement_norm: column sums of A (float64-accumulated) into norm.h5, with the
subsets' sensitivities (weighted by a measurement's multiplicative factors)."""

from mlemlib.logs import send_to_log

send_to_log(snakemake.log[0])

from mlemlib.norm import compute_norm  # noqa: E402

compute_norm(
    snakemake.input.matrix,
    snakemake.output.norm,
    threads=snakemake.threads,
    multiplicative=snakemake.params.get("multiplicative"),
)
