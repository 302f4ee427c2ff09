"""Rule simulate_measurement: project a phantom through A, add Poisson noise."""

import logging
import sys

sys.stderr = open(snakemake.log[0], "w", buffering=1)
logging.basicConfig(
    stream=sys.stderr,
    level=logging.INFO,
    format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    force=True,
)

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
