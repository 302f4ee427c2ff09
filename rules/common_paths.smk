"""Every file the workflow makes (and the timings summarize reads), by name:
its path pattern, in DAG order. The rules' output: and input:, the summary's
inputs (common_targets.smk) and the resource check (common_resources.smk)
take their paths from here, so each is written once. Each rule's log: and
benchmark: stay in the rule (nothing else reads them).
"""

# A run's directory names everything that defines its outputs: the run
# ({run}: backend and kernels; GPUs and layout) and the mlem settings
# (get_run_key), so that configurations that differ only in them keep their
# images and timings side by side and share every stage of the matrix. The
# float64 reference depends on the iteration count alone.
#
# Where a run models more than MLEM (OSEM subsets, a measurement's factors m
# and b, a prior: is_modelled), its path and its reference's also name the
# model ({model}, get_model): mlem or osem{S}, then the identities of a subset
# file and of m and b, then the MAP settings, so that two configurations never
# write one directory.
# Without them the paths stay as they were.
_MODEL = "-{model}" if is_modelled() else ""
RUN_KEY = f"it{{iterations}}-rep{{repetitions}}-ck{{checkpoint_every}}{_MODEL}"
_RUN_DIR = (
    f"results/{{matrix}}/runs/{{data}}/{{run}}-{RUN_KEY}/gpus-{{gpus}}-{{layout}}"
)
REFERENCE_KEY = f"it{{iterations}}{_MODEL}"
_REFERENCE_DIR = f"results/{{matrix}}/runs/{{data}}/reference-{REFERENCE_KEY}"
_EXACT_REFERENCE_DIR = (
    f"results/{{matrix}}/runs/{{data}}/reference-exact-{REFERENCE_KEY}"
)
# Each configuration's own summary (config key name), so that configurations
# run in one directory keep their summaries side by side.
_SUMMARY_DIR = f"results/summary/{config['name']}"

# The convergence study's folder names what defines it (config convergence):
# backend and kernels, passes, the subset counts, how often it measures, and
# whether it also ignores m and b.
_STUDY = config["convergence"]
CONVERGENCE_KEY = (
    f"{_STUDY['backend']}-{_STUDY['fp']}-{_STUDY['bp']}-it{_STUDY['iterations']}"
    f"-s{'_'.join(str(s) for s in _STUDY['subsets'])}-every{_STUDY['record_every']}"
    + ("-ignore" if _STUDY["ignore_corrections"] else "")
)

PATHS = {
    "csr4": "resources/{matrix}.csr4",
    "converted": "results/{matrix}/converted.h5",
    "matrix": "results/{matrix}/matrix.h5",
    "norm": "results/{matrix}/norm.h5",
    # the sensitivities of a measurement with multiplicative factors ({factors}: their identity)
    "measurement_norm": "results/{matrix}/data/{data}-norm-{factors}.h5",
    "transpose": "results/{matrix}/transpose.h5",
    "transpose_benchmark": "benchmarks/transpose/{matrix}.tsv",
    "compared_transpose": "results/{matrix}/transpose-{method}.h5",
    "compared_transpose_benchmark": "benchmarks/transpose/{matrix}-{method}.tsv",
    "plan": "results/{matrix}/parts-{parts}/plan.json",
    "chunks": "results/{matrix}/chunks.h5",
    "sino": "results/{matrix}/data/{data}.LMsino",
    "truth": "results/{matrix}/data/{data}-truth.h5",
    # a simulated measurement's m and b (simulation: attenuation, normalisation_spread;
    # randoms_fraction, scatter_fraction): raw float32 per LOR (docs/reconstruction.md)
    "multiplicative": "results/{matrix}/data/{data}.mult.f32",
    "additive": "results/{matrix}/data/{data}.add.f32",
    "reference_image": f"{_REFERENCE_DIR}/image.h5",
    "reference_timings": f"{_REFERENCE_DIR}/timings.json",
    "exact_reference_image": f"{_EXACT_REFERENCE_DIR}/image.h5",
    # the converged MAP image of a simulated measurement (BSREM, {iterations} passes)
    "converged_image": "results/{matrix}/runs/{data}/converged-it{iterations}-{model}/image.h5",
    "exact_reference_timings": f"{_EXACT_REFERENCE_DIR}/timings.json",
    "run_image": f"{_RUN_DIR}/image.h5",
    "run_timings": f"{_RUN_DIR}/timings.json",
    "run_raw": f"{_RUN_DIR}/image.raw",
    "run_checkpoint": f"{_RUN_DIR}/checkpoint.h5",
    "bench_csv": "results/{matrix}/bench/spmv.csv",
    "bench_md": "results/{matrix}/bench/spmv.md",
    "bench_json": "results/{matrix}/bench/spmv.json",
    "convergence": f"results/{{matrix}}/convergence/{{data}}/{CONVERGENCE_KEY}/convergence.json",
    "runs_csv": f"{_SUMMARY_DIR}/runs.csv",
    "summary_md": f"{_SUMMARY_DIR}/summary.md",
    "summary_html": f"{_SUMMARY_DIR}/summary.html",
    "runs_html": f"{_SUMMARY_DIR}/runs.html",
    "convergence_csv": f"{_SUMMARY_DIR}/convergence.csv",
    "plots": f"{_SUMMARY_DIR}/plots",
    # what warm_kernels compiled on this machine, per configuration (its runs' kernels)
    "warm": f"results/kernels/{config['name']}.json",
}


def get_path(name, **wildcards):
    """PATHS[name] with its wildcards filled in (each given by name)."""
    return PATHS[name].format(**wildcards)
