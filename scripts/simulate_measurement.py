"""Rule simulate_measurement: project a phantom through A, add Poisson noise."""

import logging

from mlemlib.logs import send_to_log

send_to_log(snakemake.log[0])

from mlemlib.phantom import simulate  # noqa: E402

sim = snakemake.params.simulation
summary = simulate(
    snakemake.input.matrix,
    sim["phantom"],
    snakemake.output.sino,
    snakemake.output.truth,
    seed=sim["seed"],
    noiseless=sim["noiseless"],
    counts=sim["counts"],
)
logging.info("simulate_measurement: %s", summary)
