"""Rule simulate_measurement: project a phantom through A, add Poisson noise
(and, where the config asks, attenuation, normalisation, randoms and scatter)."""

import logging

from mlemlib.logs import send_to_log

send_to_log(snakemake.log[0])

from mlemlib.phantom import ScannerEffects, simulate  # noqa: E402

sim = snakemake.params.simulation
effects = sim.get("effects")
summary = simulate(
    snakemake.input.matrix,
    sim["phantom"],
    snakemake.output.sino,
    snakemake.output.truth,
    seed=sim["seed"],
    noiseless=sim["noiseless"],
    counts=sim["counts"],
    effects=ScannerEffects(**effects) if effects else None,
    out_multiplicative=snakemake.output.get("multiplicative"),
    out_additive=snakemake.output.get("additive"),
)
logging.info("simulate_measurement: %s", summary)
