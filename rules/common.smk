"""Set-up of the workflow: the config's validation, the wildcard constraints,
and the helpers the rules call (get_<thing>(wildcards), is_<predicate>()),
one file per concern:

- common_files.smk: the user's files (checked before any job), their stamps
- common_runs.smk: the configured runs, the GPUs this machine gives them, and
  each (matrix, run) pair as a mlemlib.compose.Combination (the dry run's verdict)
- common_map.smk: MAP (mlem.prior): its checks, the model part naming it, the
  converged MAP image and the metrics; a user's matrix's grid
- common_paths.smk: every path the workflow makes (PATHS), by name
- common_matrix.smk: the matrix stages (convert, reorder, transpose, partition, chunks)
- common_data.smk: measurements, reconstructions, benchmark, warm-up, convergence
- common_targets.smk: what the summary reads (and so the targets of `all`)
- common_resources.smk: each job's resources, and the check of Snakemake's own
  DAG against this machine before any job runs

Everything that computes lives in mlemlib; these files only decide which files
the workflow makes and which config values each rule receives (as params, so
that a changed value reruns exactly the rules that use it). The jobs follow
from the targets and the rules' input functions: there is no list of jobs
beside Snakemake's DAG.
"""

import os
import sys
from pathlib import Path

import jsonschema
from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

from mlemlib import compose
from mlemlib.errors import EXIT_INPUT, ConfigError


def stop(line):
    """Stop the workflow before any job with `line` alone on stderr.

    Snakemake prints a WorkflowError raised while it reads the workflow with
    a "WorkflowError in file ...common.smk" header and traceback lines; a
    fault of the user's config or files is one line naming the key or file
    and the fault (exit status 2, as the mlem command's for bad input).
    """
    print(line, file=sys.stderr, flush=True)
    sys.exit(EXIT_INPUT)


# ------------------------------------------------------------- config predicates


def get_matrix_formats():
    """The matrix formats of the configured matrices (what the runs' kernels must read)."""
    return tuple(sorted({m.get("format", "csr") for m in config["matrices"].values()}))


def is_generated_direct(matrix):
    """True when generate_container writes the container of `matrix` itself
    (a preset with csr4: false): no .csr4, no conversion."""
    entry = config["matrices"][matrix]
    return bool(entry["preset"]) and not entry["csr4"]


def is_subsetted():
    """True when the runs use OSEM subsets (mlem.subsets > 1 or a subset file)."""
    return config["mlem"]["subsets"] > 1 or config["mlem"]["subset_file"] is not None


#: The keys of config simulation that make simulate_measurement write m or b.
SIMULATED_FACTOR_KEYS = (
    "attenuation",
    "normalisation_spread",
    "randoms_fraction",
    "scatter_fraction",
)


def is_background():
    """True when some measurement has an additive background b (a user's file, or simulated)."""
    users = any(
        measurement_files(value)["additive"]
        for entry in config["matrices"].values()
        for value in entry["measurements"].values()
    )
    sim = config["simulation"]
    return users or sim["randoms_fraction"] > 0 or sim["scatter_fraction"] > 0


def is_map():
    """True when the runs reconstruct MAP: a prior (config mlem.prior.type not none)."""
    return config["mlem"]["prior"]["type"] != "none"


def is_modelled():
    """True when some run models more than MLEM: subsets, a measurement's m or
    b (a user's files, or simulated ones), or a prior (MAP): the run paths
    name the model."""
    users = any(
        measurement_files(value)[role]
        for entry in config["matrices"].values()
        for value in entry["measurements"].values()
        for role in FACTOR_ROLES
    )
    simulated = any(config["simulation"][key] for key in SIMULATED_FACTOR_KEYS)
    return is_subsetted() or users or simulated or is_map()


# ----------------------------------------------------------------- config checks


def validate_config():
    """Validate the config against config/schema.yaml, filling in defaults,
    then what the schema cannot say alone (check_settings).

    A fault stops the workflow before any job with one message naming the
    key and the fault (not the whole schema).
    """
    try:
        validate(config, schema="../config/schema.yaml")
    except WorkflowError as exc:
        error = exc.__context__
        if not isinstance(error, jsonschema.ValidationError):
            raise
        path = list(error.absolute_path)
        where = "".join(
            f"[{key}]" if isinstance(key, int) else f".{key}" for key in path
        ).lstrip(".")
        fault = error.message
        if len(path) >= 2 and path[0] == "matrices" and error.validator == "oneOf":
            fault = "give exactly one of preset or path"
        stop(
            f"config {where or '(top level)'}: {fault}; "
            "config/schema.yaml lists the keys and their allowed values"
        )
    check_settings()


def check_settings():
    """Stop, in one line, on settings each valid alone that do not go together."""
    for name, entry in config["matrices"].items():
        if entry["voxel_order"] != "raster" and not is_generated_direct(name):
            stop(
                f"config matrices.{name}.voxel_order: {entry['voxel_order']} is for a "
                "preset written straight into the container (csr4: false)"
            )
        if entry["voxel_order"] != "raster" and is_subsetted():
            stop(
                f"config matrices.{name}.voxel_order: {entry['voxel_order']} stores the "
                "matrix reordered already; mlem.subsets needs the reorder stage to group "
                "its rows (use voxel_order: raster with reorder: rows+voxels)"
            )
        if entry["voxel_order"] != "raster" and config["reorder"] != "none":
            stop(
                f"config matrices.{name}.voxel_order: {entry['voxel_order']} orders the "
                f"voxels already; reorder: {config['reorder']} would reorder the matrix again "
                "(use one of them)"
            )
    for index, entry in enumerate(config["runs"]):
        for matrix in config["matrices"]:
            for run in expand_run(entry):
                try:
                    compose.check(get_combination(run, matrix), where=f"runs[{index}]")
                except ConfigError as exc:
                    stop(f"config {exc}")
    check_map_settings()


def check_convergence():
    """Stop before any job where the study cannot run: a matrix stored
    reordered already (voxel_order), whose rows the study cannot regroup."""
    if not config["convergence"]["enabled"]:
        return
    for name, entry in config["matrices"].items():
        if entry["voxel_order"] != "raster":
            stop(
                f"config convergence.enabled: matrix {name} has voxel_order "
                f"{entry['voxel_order']}, stored reordered already; the study groups "
                "each S's rows itself (use voxel_order: raster)"
            )


def check_scanner_effects():
    """Stop the workflow before any job, in one line, on scanner effects the
    schema cannot refuse alone (randoms_fraction + scatter_fraction >= 1)."""
    try:
        get_scanner_effects().check()
    except ConfigError as exc:
        stop(f"config simulation.{exc}")


include: "common_files.smk"
include: "common_runs.smk"
include: "common_map.smk"


validate_config()
validate_paths()
check_map_files()
check_convergence()

# Jobs import mlemlib from this checkout, also inside --sdm conda environments
# (which carry the dependencies only).
os.environ.update(
    PYTHONPATH=os.pathsep.join(
        p for p in (str(Path(workflow.basedir)), os.environ.get("PYTHONPATH")) if p
    )
)


wildcard_constraints:
    matrix="[A-Za-z0-9_]+",
    method="[a-z0-9_]+",
    parts="[0-9]+",
    data="[A-Za-z0-9_]+(?:-seed[0-9]+)?",
    run="(?:cpu|cuda)-[a-z0-9_]+-[a-z0-9_]+(?:-s[0-9]+)?(?:-graph|-nograph)?",
    iterations="[0-9]+",
    repetitions="[0-9]+",
    checkpoint_every="[0-9]+",
    model="[a-z0-9_]+",
    factors="m[0-9a-f]+",
    gpus="[0-9]+",
    layout="local|thesis",


include: "common_paths.smk"
include: "common_matrix.smk"
include: "common_data.smk"
include: "common_targets.smk"
include: "common_resources.smk"


check_scanner_effects()
