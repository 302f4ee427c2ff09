"""Rule warm_kernels: compile, on this machine, the kernels the workflow's GPU jobs run (mlemlib.backends.warm)."""

import logging

from mlemlib.logs import send_to_log

send_to_log(snakemake.log[0])

from mlemlib.backends.warm import warm_up, write_record  # noqa: E402
from mlemlib.dist.lease import lease_gpus  # noqa: E402

p = snakemake.params.warm
try:
    with lease_gpus(1):  # the GPU Snakemake counted for this job
        record = warm_up(p["runs"], formats=p["formats"], subsets=p["subsets"], background=p["background"],
                         bench=p["bench"], reference=p["reference"])
except Exception as exc:  # noqa: BLE001 - a warm-up only saves the GPU jobs time: they report their own faults
    logging.warning("warm_kernels: nothing compiled here (%s: %s); each GPU job compiles its kernels itself",
                    type(exc).__name__, exc)
    record = {"error": f"{type(exc).__name__}: {exc}"}
write_record(record, snakemake.output.warm)
logging.info("warm_kernels: wrote %s", snakemake.output.warm)
