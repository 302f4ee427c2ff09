"""Set-up and helpers of the workflow: config validation, wildcard constraints,
and the functions the rules call (get_<thing>(wildcards), is_<predicate>()).

Everything that computes lives in mlemlib; this file only decides which files
the workflow makes and which config values each rule receives (as params, so
that a changed value reruns exactly the rules that use it).
"""

import collections
import dataclasses
import errno
import functools
import json
import os
import sys
from pathlib import Path

import jsonschema
from snakemake.exceptions import WorkflowError
from snakemake.logging import logger
from snakemake.utils import validate

from mlemlib.errors import EXIT_INPUT, ConfigError, InputError
from mlemlib.compressed import LOSSY_FORMATS
from mlemlib.formats import file_kind
from mlemlib.registry import check_run, get_bp, uses_transpose


def get_matrix_formats():
    """The matrix formats of the configured matrices (what the runs' kernels must read)."""
    return tuple(sorted({m.get("format", "csr") for m in config["matrices"].values()}))


def is_generated_direct(matrix):
    """True when generate_container writes the container of `matrix` itself
    (a preset with csr4: false): no .csr4, no conversion."""
    entry = config["matrices"][matrix]
    return bool(entry["preset"]) and not entry["csr4"]


def stop(line):
    """Stop the workflow before any job with `line` alone on stderr.

    Snakemake prints a WorkflowError raised while it reads the workflow with
    a "WorkflowError in file ...common.smk" header and traceback lines; a
    fault of the user's config or files is one line naming the key or file
    and the fault (exit status 2, as the mlem command's for bad input).
    """
    print(line, file=sys.stderr, flush=True)
    sys.exit(EXIT_INPUT)


def validate_config():
    """Validate the config against config/schema.yaml, filling in defaults.

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
        gpus = entry["gpus"] if isinstance(entry["gpus"], list) else [entry["gpus"]]
        if entry["backend"] == "cpu" and gpus != [1]:
            stop(
                f"config runs[{index}].gpus: a run with backend cpu takes 1, "
                f"found {entry['gpus']}"
            )
        try:
            check_run(entry, where=f"runs[{index}]", formats=get_matrix_formats())
        except ConfigError as exc:
            stop(f"config {exc}")
        if (
            entry["backend"] == "cpu"
            and entry["bp"] == "onepass_chunked"
            and is_background()
        ):
            stop(
                f"config runs[{index}].bp: onepass_chunked on the cpu takes no additive "
                "background (b); use onepass or numba"
            )


#: What a configured file must be, by role: its kinds (mlemlib.formats.file_kind)
#: and how a message names them.
FILE_ROLES = {
    "matrix": (
        ("csr4", "mtx", "npz", "h5"),
        "a system matrix: .csr4, .mtx, .mtx.gz, .npz or .h5",
    ),
    "measurement": (("lmsino",), "a measurement: .LMsino or .sino"),
}

#: How files of some kinds start (compared in lower case), and the kind's name.
MAGIC = {
    "mtx": ((b"%%matrixmarket", b"\x1f\x8b"), "Matrix Market"),  # or gzipped
    "npz": ((b"pk\x03\x04",), "SciPy .npz (zip)"),
    "h5": ((b"\x89hdf\r\n\x1a\n",), "HDF5"),
}


def _file_fault(path, role):
    """Why `path` is not a readable file of `role` (FILE_ROLES); None if it is one.

    Cheap enough for every dry run: the file's type, its first bytes and, for
    a .csr4, its header against its size (mlemlib.formats.csr4.read_header);
    convert_matrix and the reconstructions validate the whole file.
    """
    kinds, expected = FILE_ROLES[role]
    if not os.path.exists(path):
        return "no such file"
    if not os.path.isfile(path):
        return "not a file (a directory?)"
    try:
        kind = file_kind(path)
    except InputError:
        kind = None
    if kind not in kinds:
        return f"unsupported file type, expected {expected}"
    try:
        with open(path, "rb") as fh:
            head = fh.read(16)
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if not head:
        return "empty file"
    if kind == "csr4":
        from mlemlib.formats.csr4 import read_header

        try:
            read_header(path)
        except InputError as exc:
            return exc.fault
    elif kind == "lmsino" and os.path.getsize(path) % 4:
        return "size is not a multiple of 4 bytes (int32 counts)"
    elif kind in MAGIC and not head.lower().startswith(MAGIC[kind][0]):
        return f"not a {MAGIC[kind][1]} file (it starts with {head[:8]!r})"
    return None


#: Where validate_paths records the files whose contents it read and found
#: valid, by path, size and modification time, so that a file is read whole
#: once per version, not at every dry run.
CHECKED_FILES = ".snakemake/mlemlib/checked-files.json"


def _read_checked(path, check):
    """check(path) (a JSON value; raises InputError on a fault), once per version of path."""
    stat = os.stat(path)
    key = f"{check.__name__} {os.path.abspath(path)} {stat.st_size} {stat.st_mtime_ns}"
    try:
        with open(CHECKED_FILES, encoding="utf-8") as fh:
            checked = json.load(fh)
    except (OSError, ValueError):
        checked = {}
    if key in checked:
        return checked[key]
    value = checked[key] = check(path)
    try:
        os.makedirs(os.path.dirname(CHECKED_FILES), exist_ok=True)
        with open(f"{CHECKED_FILES}.{os.getpid()}", "w", encoding="utf-8") as fh:
            json.dump(checked, fh)
        os.replace(f"{CHECKED_FILES}.{os.getpid()}", CHECKED_FILES)
    except OSError:
        pass  # a read-only working directory: check again next time
    return value


def matrix_rows(path):
    """Rows (LORs) of a user's matrix file, read and validated by mlemlib.formats
    (mlemlib.cluster.matrix_size: a .csr4's or .h5's header; a .mtx or .npz
    whole, with every index and value checked)."""
    from mlemlib.cluster import matrix_size

    return matrix_size(path).rows


def measurement_ok(path):
    """True when mlemlib.formats.lmsino reads the measurement (counts >= 0); raises InputError else."""
    from mlemlib.formats.lmsino import read_lmsino

    read_lmsino(path)
    return True


def validate_paths():
    """Stop the workflow unless every configured file is a valid file of its kind.

    Checked on every run, dry runs included, so that a wrong path stops the
    workflow with one line naming the config key and the path, even where
    the results of an earlier path are on disk (Snakemake does not look at
    the inputs of outputs it considers up to date). Then the contents, as
    mlemlib.formats reads them (matrix_rows, measurement_ok; once per file
    version): a .mtx index out of range, an .npz that holds no sparse
    matrix, a negative count stop the dry run, not a job. A measurement must
    have one count per row of its matrix.
    """
    deep = not (workflow.remote_exec or workflow.subprocess_exec)
    for name, entry in config["matrices"].items():
        rows = None
        if entry["path"] is not None:
            path = entry["path"]
            fault = _file_fault(path, "matrix")
            if not fault and deep:
                try:
                    rows = _read_checked(path, matrix_rows)
                except InputError as exc:
                    fault = exc.fault
            if fault:
                stop(f"config matrices.{name}.path: {path}: {fault}")
        for data, value in entry["measurements"].items():
            files = measurement_files(value)
            path = files["counts"]
            for role in FACTOR_ROLES:
                fault = files[role] and _factor_fault(files[role], rows)
                if fault:
                    stop(
                        f"config matrices.{name}.measurements.{data}.{role}: "
                        f"{files[role]}: {fault}"
                    )
            fault = _file_fault(path, "measurement")
            if not fault and rows is not None and os.path.getsize(path) != 4 * rows:
                fault = (
                    f"{os.path.getsize(path) // 4} counts, but the matrix "
                    f"{entry['path']} has {rows} rows (LORs)"
                )
            if not fault and deep:
                try:
                    _read_checked(path, measurement_ok)
                except InputError as exc:
                    fault = exc.fault
            if fault:
                stop(f"config matrices.{name}.measurements.{data}: {path}: {fault}")
    subset_file = config["mlem"]["subset_file"]
    fault = subset_file and _factor_fault(subset_file, None, "int32 subset label")
    if fault:
        stop(f"config mlem.subset_file: {subset_file}: {fault}")


#: The measurement's factor files (mlemlib.corrections): multiplicative m, additive b.
FACTOR_ROLES = ("multiplicative", "additive")


def measurement_files(value):
    """A user's measurement entry (a path, or {counts, multiplicative, additive})
    as a dict of the three (None: not given)."""
    if isinstance(value, str):
        return {"counts": value, "multiplicative": None, "additive": None}
    return {"counts": value["counts"], **{r: value.get(r) for r in FACTOR_ROLES}}


def _factor_fault(spec, rows, what="float32 value"):
    """Why `spec` (a raw file of one `what` per LOR, or FILE.h5:/dataset) is not
    usable; None if it may be (the run reads and checks every value)."""
    from mlemlib.corrections import split_h5

    path, dataset = split_h5(spec)
    if not os.path.isfile(path):
        return "no such file"
    if dataset is not None or path.lower().endswith((".h5", ".hdf5")):
        return None
    size = os.path.getsize(path)
    if size % 4:
        return f"size {size} is not a multiple of 4 bytes (one {what} per LOR)"
    if rows is not None and size != 4 * rows:
        return f"{size // 4} values, but the matrix has {rows} rows (LORs)"
    return None


def is_subsetted():
    """True when the runs use OSEM subsets (mlem.subsets > 1 or a subset file)."""
    return config["mlem"]["subsets"] > 1 or config["mlem"]["subset_file"] is not None


#: The keys of config simulation that make simulate_measurement write m or b.
_SIMULATED_FACTOR_KEYS = (
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


def is_modelled():
    """True when some run models more than MLEM: subsets, or a measurement's
    m or b (a user's files, or simulated ones): the run paths name the model."""
    users = any(
        measurement_files(value)[role]
        for entry in config["matrices"].values()
        for value in entry["measurements"].values()
        for role in FACTOR_ROLES
    )
    simulated = any(config["simulation"][key] for key in _SIMULATED_FACTOR_KEYS)
    return is_subsetted() or users or simulated


validate_config()
validate_paths()

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


# ------------------------------------------------------------------- paths
# Every file the workflow makes (and the timings summarize reads), by name:
# its path pattern, in DAG order. The rules' output: and input:, the targets
# of `all` (get_jobs, get_summary_input) and the resource check
# (get_stage_needs) take their paths from here, so each is written once. Each
# rule's log: and benchmark: stay in the rule (nothing else reads them).

# A run's directory names everything that defines its outputs: the run
# ({run}: backend and kernels; GPUs and layout) and the mlem settings
# (get_run_key), so that configurations that differ only in them keep their
# images and timings side by side and share every stage of the matrix. The
# float64 reference depends on the iteration count alone.
#
# Where a run models more than MLEM (OSEM subsets, a measurement's factors m
# and b: is_modelled), its path and its reference's also name the model
# ({model}, get_model): mlem or osem{S}, then the identities of a subset file
# and of m and b, so that two configurations never write one directory.
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


# ----------------------------------------------------------------- predicates


def _global_resource(name):
    """--resources name=N as an int; None where not given."""
    value = workflow.global_resources.get(name)
    value = getattr(value, "value", value)
    return int(value) if isinstance(value, (int, float)) else None


@functools.cache
def get_gpu_limits():
    """What caps a cuda run's GPU count here: {why: count}, empty for no cap.

    ``use_gpu: auto`` counts, once, the GPUs CuPy sees on this machine (0
    without CuPy or a driver; no CUDA context is created); ``false`` gives 0;
    ``true`` sets no cap of its own (a cluster whose login node has no GPU).
    With ``gpu_runs: fit`` (the default) the node's GPUs (``node.gpus``, where
    a number) and ``--resources gpu=N`` cap it too; ``gpu_runs: all`` keeps
    every run within use_gpu, and the resource check refuses one the node
    cannot give its GPUs.
    """
    limits = {}
    setting = config["use_gpu"]
    if setting in (False, "false"):
        limits["use_gpu: false (0)"] = 0
    elif setting not in (True, "true"):
        from mlemlib.backends import cuda_available

        count = 0
        if cuda_available():
            import cupy

            count = cupy.cuda.runtime.getDeviceCount()
        limits[f"use_gpu: auto ({count} visible here)"] = count
    if config["gpu_runs"] == "fit":
        if isinstance(config["node"]["gpus"], int):
            limits[f"node.gpus: {config['node']['gpus']}"] = config["node"]["gpus"]
        if _global_resource("gpu") is not None:
            limits[f"--resources gpu={_global_resource('gpu')}"] = _global_resource(
                "gpu"
            )
    return limits


def get_gpu_limit():
    """Most GPUs a cuda run may use here (get_gpu_limits); None for no limit."""
    return min(get_gpu_limits().values(), default=None)


def report_left_out_runs():
    """Log, in one line, the configured cuda runs get_gpu_limit() leaves out.

    Skipped inside jobs (Snakemake parses the workflow again there).
    """
    if workflow.remote_exec or workflow.subprocess_exec:
        return
    left = [run for run in _all_runs().values() if not is_run_possible(run)]
    if not left:
        return
    limit = get_gpu_limit()
    binding = [k for k, v in get_gpu_limits().items() if v == limit]
    why = " and ".join(binding)
    names = ", ".join(
        f"{run['name']} on {run['gpus']} GPU{'s' if run['gpus'] > 1 else ''}"
        + (f" {run['layout']}" if run["gpus"] > 1 else "")
        for run in left
    )
    keep = ""
    if any(not k.startswith("use_gpu") for k in binding):
        keep = "; gpu_runs: all keeps them"
    logger.warning(
        f"runs left out, {len(left)} (they need more GPUs than {why}{keep}): {names}"
    )


def is_gpu_enabled():
    """True when runs with backend cuda (and the SpMV benchmark) belong to the DAG."""
    limit = get_gpu_limit()
    return limit is None or limit > 0


def is_reference_enabled():
    """True when every problem gets a float64 CPU reference MLEM."""
    return bool(config["mlem"]["reference"])


def is_simulated(wildcards):
    """True when the measurement {data} is simulated (it has a ground truth)."""
    return wildcards.data not in get_user_measurements(wildcards.matrix)


# -------------------------------------------------------------------- matrices


def get_matrices():
    """Names of the configured system matrices."""
    return list(config["matrices"])


def get_preset(wildcards):
    """Scanner preset of a generated matrix."""
    return config["matrices"][wildcards.matrix]["preset"]


def get_matrix_source(wildcards):
    """The file convert_matrix reads: the user's file or the generated .csr4."""
    entry = config["matrices"][wildcards.matrix]
    if entry["path"] is not None:
        return entry["path"]
    return get_path("csr4", matrix=wildcards.matrix)


def _file_stamp(path):
    """What identifies the contents of a user's file: its path, size and mtime."""
    stat = os.stat(path)
    return {"path": path, "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def get_matrix_stamp(wildcards):
    """Provenance of convert_matrix's source, a param so that any change reruns it.

    A user's file: its path, size and modification time, so that pointing
    the config at another file, or replacing the file with one of another
    size or time (even an older one), reruns the conversion and what follows.
    A generated matrix: its preset (generate_matrix's output is tracked by
    Snakemake itself).
    """
    entry = config["matrices"][wildcards.matrix]
    if entry["path"] is None:
        return {"preset": entry["preset"]}
    return _file_stamp(entry["path"])


def _names_regex(names):
    return "|".join(names) if names else "(?!)"


def get_generated_matrix_regex():
    """Wildcard regex of the matrices generate_matrix makes as .csr4 (presets with csr4: true)."""
    names = [
        name
        for name, entry in config["matrices"].items()
        if entry["preset"] and not is_generated_direct(name)
    ]
    return _names_regex(names)


def get_direct_matrix_regex():
    """Wildcard regex of the matrices generate_container writes directly."""
    return _names_regex(
        [name for name in config["matrices"] if is_generated_direct(name)]
    )


def get_converted_matrix_regex():
    """Wildcard regex of the matrices convert_matrix makes (every other one)."""
    return _names_regex(
        [name for name in config["matrices"] if not is_generated_direct(name)]
    )


def get_matrix_fold(wildcards):
    """Whether results/{matrix}/matrix.h5 stores each distinct row once (docs/formats.md, "Folded matrices")."""
    return bool(config["matrices"][wildcards.matrix]["fold"])


def get_voxel_order(wildcards):
    """Column order of a matrix the generator writes into its container: raster or hilbert."""
    return config["matrices"][wildcards.matrix]["voxel_order"]


def get_matrix_format(wildcards):
    """Matrix format of results/{matrix}/matrix.h5: csr or a compressed format (docs/formats.md)."""
    return config["matrices"][wildcards.matrix]["format"]


def get_exact_source(matrix):
    """The lossless file a matrix stored in a lossy format (compressed-f16,
    compressed-u16) is converted from: the generated .csr4 or the user's file.
    None for a lossless format, a preset generated straight into its
    container, or a user's file that is itself a lossy container."""
    entry = config["matrices"][matrix]
    if entry["format"] not in LOSSY_FORMATS or is_generated_direct(matrix):
        return None
    if entry["path"] is None:
        return get_path("csr4", matrix=matrix)
    if file_kind(entry["path"]) == "h5":
        path = Path(entry["path"])
        if h5_is_lossy(str(path), path.stat().st_mtime_ns):
            return None
    return entry["path"]


@functools.lru_cache(maxsize=None)
def h5_is_lossy(path, mtime_ns):
    """Whether the HDF5 matrix at path is a lossy compressed container (read
    once per file version, not at every evaluation of the DAG)."""
    import h5py

    from mlemlib.formats.compressed_h5 import FORMATS

    with h5py.File(path, "r") as f:
        return FORMATS.get(f.attrs.get("format")) in LOSSY_FORMATS


def get_exact_reference_input(wildcards):
    """Named inputs of exact_reference_mlem: the problem's, with the lossless
    source for the matrix and no norm (the source's own column sums)."""
    inputs = get_problem_input(wildcards)
    del inputs["norm"]
    inputs["matrix"] = get_exact_source(wildcards.matrix)
    return inputs


def get_transpose_method(wildcards=None):
    """The method that writes results/{matrix}/transpose.h5."""
    return config["transpose"]["method"]


def get_transpose_gpus(wildcards):
    """GPUs a transposition occupies: 1 for cusparse, else 0."""
    method = getattr(wildcards, "method", None) or get_transpose_method()
    return 1 if method == "cusparse" else 0


def get_compared_transpose_methods():
    """Further transposition methods timed for the comparison table."""
    default = get_transpose_method()
    return [
        method
        for method in config["transpose"]["compare"]
        if method != default and (method != "cusparse" or is_gpu_enabled())
    ]


# --------------------------------------------------------------------- reorder


def is_reordered():
    """True when reorder_matrix makes results/{matrix}/matrix.h5 (reorder: rows
    or rows+voxels, or OSEM subsets, whose rows it groups)."""
    return config["reorder"] != "none" or is_subsetted()


def get_reorder_mode(wildcards):
    """The permutation reorder_matrix computes: none (subsets only), rows or rows+voxels."""
    return config["reorder"]


def get_subsets(wildcards=None):
    """OSEM subsets S of the reorder stage (its rows grouped) and of every run."""
    return config["mlem"]["subsets"]


def get_subset_input(wildcards=None):
    """Named input subset_file (the user's subsets, mlem.subset_file) where configured."""
    path = config["mlem"]["subset_file"]
    return {"subset_file": path} if path else {}


def get_converted_matrix():
    """Path pattern of the user's matrix as convert_matrix writes it (and
    simulate_measurement reads it): matrix.h5, or converted.h5 when
    reorder_matrix makes matrix.h5 from it."""
    return PATHS["converted"] if is_reordered() else PATHS["matrix"]


# ------------------------------------------------------------------ convergence


def is_convergence_enabled():
    """True when the convergence study runs (config convergence.enabled; with
    backend cuda only where cuda runs are let in, use_gpu)."""
    study = config["convergence"]
    return study["enabled"] and (study["backend"] == "cpu" or is_gpu_enabled())


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


check_convergence()


def get_convergence_input(wildcards):
    """Named inputs of study_convergence: the matrix in the user's row order
    (each S groups its rows), the measurement, its truth and its m and b."""
    return {
        "matrix": get_converted_matrix().format(matrix=wildcards.matrix),
        "sino": get_path("sino", matrix=wildcards.matrix, data=wildcards.data),
        "truth": get_path("truth", matrix=wildcards.matrix, data=wildcards.data),
        **get_simulated_factors(wildcards),
        **(get_warm_input() if is_cuda_study() else {}),
    }


def is_cuda_study():
    """True when the convergence study runs, on a GPU."""
    return is_convergence_enabled() and config["convergence"]["backend"] == "cuda"


def get_convergence_gpus(wildcards):
    """GPUs a study_convergence job takes: 1 with backend cuda, else 0."""
    return 1 if config["convergence"]["backend"] == "cuda" else 0


def get_convergence_params(wildcards):
    """The study's settings (config convergence but enabled)."""
    return {k: v for k, v in config["convergence"].items() if k != "enabled"}


# ----------------------------------------------------------------------- chunks


def get_chunk_window():
    """Voxels per chunk of chunk_matrix: mlemlib.chunked.DEFAULT_WINDOW (what an
    H100's or H200's shared memory holds; a GPU with less refuses the file)."""
    from mlemlib.chunked import DEFAULT_WINDOW

    return DEFAULT_WINDOW


def get_chunk_cap():
    """Most non-zeros per chunk of chunk_matrix: mlemlib.chunked.MAX_CHUNK_NNZ
    (a params entry, so that a changed rule makes chunks.h5 again)."""
    from mlemlib.chunked import MAX_CHUNK_NNZ

    return MAX_CHUNK_NNZ


def is_chunked_run(run):
    """True when a run reads results/{matrix}/chunks.h5: a cuda run on one GPU
    or in the local layout whose bp reads row chunks (onepass_chunked), or
    whose bp and fp are auto on a matrix the reorder stage ordered (auto
    takes the chunked one pass where the chunks reuse voxels)."""
    if run["backend"] != "cuda" or (run["gpus"] > 1 and run["layout"] != "local"):
        return False
    if run["bp"] == "auto":
        return run["fp"] == "auto" and is_reordered()
    return get_bp("cuda", run["bp"]).chunks


def is_chunks_needed():
    """True when some run reads chunks.h5 (is_chunked_run)."""
    return any(is_chunked_run(run) for run in get_runs())


# ------------------------------------------------------------------- partitions


def get_part_counts():
    """Part counts to plan: the partition table's plus every multi-GPU run's."""
    counts = set(config["partition"]["parts"])
    counts.update(run["gpus"] for run in get_runs() if run["gpus"] > 1)
    return sorted(counts)


def get_parts(wildcards):
    """Part count of partition_matrix (the {parts} wildcard as an integer)."""
    return int(wildcards.parts)


def _runs_of(parts):
    return [run for run in get_runs() if run["gpus"] == parts]


def is_local_transpose(parts, matrix):
    """True when partition_matrix writes part-{k}.h5 (A_k^T) for `parts` GPUs
    (else the plan only references A): a local-layout run on `parts` GPUs
    back-projects on a stored A_k^T and the matrix is compressed. The GPUs
    transpose a CSR block themselves (cuSPARSE), not a compressed one."""
    if config["matrices"][matrix].get("format", "csr") == "csr":
        return False
    return any(
        run["layout"] == "local" and uses_transpose(run["backend"], run["bp"])
        for run in _runs_of(parts)
    )


def is_partition_transposed(parts, matrix):
    """True when the plan of `parts` needs transpose.h5: for part-{k}.h5, or
    for the row blocks of A^T of a thesis-layout run."""
    return is_local_transpose(parts, matrix) or any(
        run["layout"] == "thesis" for run in _runs_of(parts)
    )


def get_partition_input(wildcards):
    """Named inputs of partition_matrix: the matrix, and transpose.h5 where needed."""
    inputs = {"matrix": get_path("matrix", matrix=wildcards.matrix)}
    if is_partition_transposed(int(wildcards.parts), wildcards.matrix):
        inputs["transpose"] = get_path("transpose", matrix=wildcards.matrix)
    return inputs


def get_local_transpose(wildcards):
    """Whether partition_matrix writes the parts' A_k^T (is_local_transpose)."""
    return is_local_transpose(int(wildcards.parts), wildcards.matrix)


def run_reads_transpose(run, matrix):
    """True when a run reads transpose.h5 itself: a cpu run whose back
    projection reads A^T, a thesis-layout run (its row blocks of A^T), and a
    one-GPU run of such a kernel on a compressed matrix. A GPU transposes a
    CSR matrix (or its block of rows, in the local layout) itself with
    cuSPARSE, faster than reading A^T from disk, and a compressed block's
    A_k^T comes from the partition's part files."""
    if not uses_transpose(run["backend"], run["bp"]):
        return False
    if run["backend"] != "cuda":
        return True
    if run["gpus"] > 1:
        return run["layout"] == "thesis"
    return config["matrices"][matrix].get("format", "csr") != "csr"


def is_transpose_needed(matrix):
    """True when some job reads results/{matrix}/transpose.h5: a run that
    reads it (run_reads_transpose), a partition that needs it
    (is_partition_transposed) or the transposition comparison. Runs without
    a transpose (notrans, the one-pass iteration), GPU runs on a CSR matrix
    and the SpMV benchmark (it transposes on its GPU where no transpose.h5 is
    made) never make one."""
    return (
        any(run_reads_transpose(run, matrix) for run in get_runs())
        or any(is_partition_transposed(parts, matrix) for parts in get_part_counts())
        or bool(get_compared_transpose_methods())
    )


# ------------------------------------------------------------------ measurements


def get_user_measurements(matrix):
    """The user's measurements of one matrix: name -> .LMsino path."""
    return {
        name: measurement_files(value)["counts"]
        for name, value in config["matrices"][matrix]["measurements"].items()
    }


def get_factor_specs(wildcards):
    """The m and b of {data} as the reconstructions read them: role -> file
    (a user's raw file or FILE.h5:/dataset, or the simulated file)."""
    user = config["matrices"][wildcards.matrix]["measurements"]
    if wildcards.data in user:
        files = measurement_files(user[wildcards.data])
        return {role: files[role] for role in FACTOR_ROLES if files[role]}
    return get_simulated_factors(wildcards)


def file_digest(path):
    """blake2b-128 of a file's bytes (hex), read in 16 MiB blocks."""
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _factor_identity(wildcards, role):
    """8 hex digits that identify {data}'s factor file of `role` ("" without one):
    a user's file's contents (and dataset), or the simulation's settings."""
    import hashlib

    from mlemlib.corrections import split_h5

    spec = get_factor_specs(wildcards).get(role)
    if not spec:
        return ""
    if not is_simulated(wildcards):
        path, dataset = split_h5(spec)
        text = f"{_read_checked(path, file_digest)}:{dataset or ''}"
    else:
        text = json.dumps(get_simulation_params(wildcards), sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=4).hexdigest()


def get_model(matrix, data):
    """{model} of the runs of {matrix} x {data} (is_modelled): mlem or osem{S},
    then _f, _m and _b with the identities of the subset file, m and b."""
    mlem = config["mlem"]
    wildcards = Wildcards(matrix=matrix, data=data)
    parts = [f"osem{mlem['subsets']}" if is_subsetted() else "mlem"]
    if mlem["subset_file"]:
        parts.append(f"f{_read_checked(mlem['subset_file'], file_digest)[:8]}")
    for role, letter in (("multiplicative", "m"), ("additive", "b")):
        identity = _factor_identity(wildcards, role)
        if identity:
            parts.append(letter + identity)
    return "_".join(parts)


def get_norm_factors(wildcards):
    """{factors} of {data}'s own norm: m and the identity of its multiplicative
    factors; None without them (the matrix's norm.h5 serves)."""
    identity = _factor_identity(wildcards, "multiplicative")
    return f"m{identity}" if identity else None


def get_measurement_norm(wildcards):
    """The norm.h5 of {data}: its own sensitivities where it has multiplicative
    factors (compute_measurement_norm), else the matrix's."""
    factors = get_norm_factors(wildcards)
    if factors is None:
        return get_path("norm", matrix=wildcards.matrix)
    return get_path(
        "measurement_norm",
        matrix=wildcards.matrix,
        data=wildcards.data,
        factors=factors,
    )


def get_measurement_norm_input(wildcards):
    """Named inputs of compute_measurement_norm: the matrix and the factor file."""
    from mlemlib.corrections import split_h5

    spec = get_factor_specs(wildcards)["multiplicative"]
    return {
        "matrix": get_path("matrix", matrix=wildcards.matrix),
        "multiplicative": split_h5(spec)[0],
    }


def get_measurement_norm_params(wildcards):
    """The multiplicative factors compute_measurement_norm weights by (a file or FILE.h5:/dataset)."""
    return get_factor_specs(wildcards)["multiplicative"]


Wildcards = collections.namedtuple("Wildcards", "matrix data")


def get_simulated_measurements():
    """Names {phantom}-seed{seed} of the simulated measurements (one seed if noiseless)."""
    sim = config["simulation"]
    seeds = sim["seeds"][:1] if sim["noiseless"] else sim["seeds"]
    return [f"{phantom}-seed{seed}" for phantom in sim["phantoms"] for seed in seeds]


def get_simulated_data_regex():
    """Wildcard regex of {data} of simulate_measurement: {phantom}-seed{seed}."""
    return "[A-Za-z0-9_]+-seed[0-9]+"


def get_measurements(matrix):
    """Every measurement reconstructed with one matrix: simulated and the user's."""
    return get_simulated_measurements() + list(get_user_measurements(matrix))


def get_measurement(wildcards):
    """The .LMsino of {data}: the user's file or the simulated one."""
    user = get_user_measurements(wildcards.matrix)
    if wildcards.data in user:
        return user[wildcards.data]
    return get_path("sino", matrix=wildcards.matrix, data=wildcards.data)


def get_measurement_stamp(wildcards):
    """Provenance of {data}: a user's file's path, size and mtime; None if simulated.

    A param of the reconstructions, so that a user's measurement replaced by
    another file reruns them (as get_matrix_stamp does for a matrix).
    """
    user = get_user_measurements(wildcards.matrix)
    if wildcards.data in user:
        return _file_stamp(user[wildcards.data])
    return None


def get_simulation_params(wildcards):
    """Phantom, seed and noise settings of simulate_measurement ({data} is
    {phantom}-seed{seed}), and the scanner effects where any is on (left out
    otherwise, so that a config without them keeps today's params and outputs)."""
    sim = config["simulation"]
    phantom, seed = wildcards.data.rsplit("-seed", 1)
    params = {
        "phantom": phantom,
        "seed": int(seed),
        "noiseless": sim["noiseless"],
        "counts": sim["counts"],
    }
    effects = get_scanner_effects()
    if effects.any:
        params["effects"] = dataclasses.asdict(effects)
    return params


#: The keys of config simulation that are mlemlib.phantom.ScannerEffects' fields.
SCANNER_EFFECTS = (
    "attenuation",
    "normalisation_spread",
    "normalisation_seed",
    "randoms_fraction",
    "scatter_fraction",
)


def get_scanner_effects():
    """mlemlib.phantom.ScannerEffects of config simulation (checked by check_scanner_effects)."""
    from mlemlib.phantom import ScannerEffects

    sim = config["simulation"]
    return ScannerEffects(**{key: sim[key] for key in SCANNER_EFFECTS})


def check_scanner_effects():
    """Stop the workflow before any job, in one line, on scanner effects the
    schema cannot refuse alone (randoms_fraction + scatter_fraction >= 1)."""
    try:
        get_scanner_effects().check()
    except ConfigError as exc:
        stop(f"config simulation.{exc}")


check_scanner_effects()


def get_simulated_factor_roles():
    """The factor files simulate_measurement writes: multiplicative (attenuation,
    normalisation) and additive (randoms, scatter), where the config asks."""
    effects = get_scanner_effects()
    flags = {"multiplicative": effects.multiplicative, "additive": effects.additive}
    return [role for role, on in flags.items() if on]


def get_simulation_outputs():
    """Named outputs of simulate_measurement beyond sino and truth: the path
    patterns of its factor files (get_simulated_factor_roles)."""
    return {role: PATHS[role] for role in get_simulated_factor_roles()}


def get_simulated_factors(wildcards):
    """The m and b files of a simulated {data} (role -> path) that every
    reconstruction of it reads, as the measurement's multiplicative and
    additive entries; empty for a user's measurement."""
    if not is_simulated(wildcards):
        return {}
    return {
        role: get_path(role, matrix=wildcards.matrix, data=wildcards.data)
        for role in get_simulated_factor_roles()
    }


# ------------------------------------------------------------------------ runs


def _as_list(value):
    return value if isinstance(value, list) else [value]


def _run_name(entry):
    name = f"{entry['backend']}-{entry['fp']}-{entry['bp']}"
    if entry["secsize"] is not None:
        name += f"-s{entry['secsize']}"
    if entry["graph"] is True:
        name += "-graph"
    elif entry["graph"] is False:
        name += "-nograph"
    return name


@functools.cache
def _all_runs():
    """Every configured run, expanded over GPU counts and layouts (cached)."""
    runs = {}
    for entry in config["runs"]:
        for gpus in _as_list(entry["gpus"]):
            # One GPU has no layout to choose: its run is "local".
            layouts = _as_list(entry["layout"]) if gpus > 1 else ["local"]
            for layout in layouts:
                run = {
                    "name": _run_name(entry),
                    "backend": entry["backend"],
                    "fp": entry["fp"],
                    "bp": entry["bp"],
                    "secsize": entry["secsize"],
                    "graph": entry["graph"],
                    "gpus": gpus,
                    "layout": layout,
                }
                runs[(run["name"], gpus, layout)] = run
    return runs


def is_run_possible(run):
    """True for cpu runs, and for cuda runs within get_gpu_limit()."""
    if run["backend"] == "cpu":
        return True
    limit = get_gpu_limit()
    return limit is None or run["gpus"] <= limit


def get_runs():
    """The runs of this workflow: every configured run that is_run_possible()."""
    return [run for run in _all_runs().values() if is_run_possible(run)]


def get_run(wildcards):
    """Settings of one run: backend, fp, bp, secsize, graph, gpus, layout."""
    key = (wildcards.run, int(wildcards.gpus), wildcards.layout)
    run = _all_runs().get(key)
    if run is None:
        raise ValueError(
            f"no configured run {wildcards.run} with gpus {wildcards.gpus} "
            f"and layout {wildcards.layout}"
        )
    return {
        k: run[k] for k in ("backend", "fp", "bp", "secsize", "graph", "gpus", "layout")
    }


def get_run_key():
    """The wildcards of RUN_KEY, from config mlem: the settings that define a run's outputs."""
    mlem = config["mlem"]
    return {k: mlem[k] for k in ("iterations", "repetitions", "checkpoint_every")}


def get_mlem_params(wildcards):
    """Iteration settings of a run, as its path names them (RUN_KEY), and its
    model: subsets and the factor files (get_model)."""
    return {
        "iterations": int(wildcards.iterations),
        "checkpoint_every": int(wildcards.checkpoint_every),
        "repetitions": int(wildcards.repetitions),
        **get_model_params(wildcards),
    }


def get_reference_params(wildcards):
    """Iteration count of the float64 reference, as its path names it, and its model."""
    return {"iterations": int(wildcards.iterations), **get_model_params(wildcards)}


def get_model_params(wildcards):
    """What a reconstruction models beyond MLEM: subsets (S) and the factor
    files (role -> file or FILE.h5:/dataset) of {data}."""
    return {"subsets": get_subsets(), "factors": get_factor_specs(wildcards)}


def get_problem_input(wildcards):
    """Named inputs every reconstruction of {matrix} x {data} reads."""
    matrix, data = wildcards.matrix, wildcards.data
    inputs = {
        "matrix": get_path("matrix", matrix=matrix),
        "norm": get_measurement_norm(wildcards),
        "sino": get_measurement(wildcards),
    }
    if is_simulated(wildcards):
        inputs["truth"] = get_path("truth", matrix=matrix, data=data)
    inputs.update(get_simulated_factors(wildcards))
    inputs.update(get_user_factor_files(wildcards))
    inputs.update(get_subset_input())
    return inputs


def get_user_factor_files(wildcards):
    """The files of a user's m and b of {data} (role -> path; the params say which dataset)."""
    from mlemlib.corrections import split_h5

    if is_simulated(wildcards):
        return {}
    return {
        role: split_h5(spec)[0] for role, spec in get_factor_specs(wildcards).items()
    }


def get_mlem_input(wildcards):
    """Named inputs of run_mlem: the problem, plus transpose, plan and chunks as
    needed. Not the float64 reference: no run waits for it; the summary
    measures every run against it (get_summary_input)."""
    run = get_run(wildcards)
    inputs = get_problem_input(wildcards)
    matrix = wildcards.matrix
    if run_reads_transpose(run, matrix):
        inputs["transpose"] = get_path("transpose", matrix=matrix)
    if run["gpus"] > 1:
        inputs["plan"] = get_path("plan", matrix=matrix, parts=run["gpus"])
    if is_chunked_run(run):
        inputs["chunks"] = get_path("chunks", matrix=matrix)
    if run["backend"] == "cuda":
        inputs.update(get_warm_input())
    return inputs


def get_checkpoint(wildcards):
    """Checkpoint file of a run (kept by an interrupted job so a rerun resumes)."""
    return get_path("run_checkpoint", **dict(wildcards.items()))


def get_mlem_gpus(wildcards):
    """GPUs a run occupies (the `gpu` resource): its GPU count for cuda, else 0."""
    run = get_run(wildcards)
    return run["gpus"] if run["backend"] == "cuda" else 0


def get_mlem_threads(wildcards):
    """Host threads of a run: every core for cpu runs, one per GPU for cuda."""
    run = get_run(wildcards)
    return workflow.cores if run["backend"] == "cpu" else run["gpus"]


def get_half_threads(wildcards=None):
    """Host threads of norm and simulate, which start together once the
    matrix is converted: half the cores each, less the SpMV benchmark's one
    where it runs, so that the benchmark (the longest GPU job) starts beside
    them."""
    bench = 1 if is_bench_enabled() else 0
    return max(1, (workflow.cores - bench) // 2)


def get_reference_threads(wildcards):
    """Host threads of the float64 reference: every core but one per GPU
    that the GPU jobs (cuda runs, the SpMV benchmark) can hold at once, so
    that no GPU job waits for the reference's cores."""
    if not is_gpu_enabled():
        return workflow.cores
    gpus = sum(run["gpus"] for run in get_runs() if run["backend"] == "cuda")
    gpus += 1 if is_bench_enabled() else 0
    limit = get_gpu_limit()
    held = gpus if limit is None else min(gpus, limit)
    return max(1, workflow.cores - held)


# ------------------------------------------------------------------- benchmark


def is_bench_enabled():
    """True when the SpMV benchmark runs (it needs a GPU)."""
    return config["bench"]["spmv"] and is_gpu_enabled()


def get_bench_input(wildcards):
    """Named inputs of bench_spmv: the matrix, and transpose.h5 where the
    workflow makes it anyway (else the benchmark transposes on its GPU); the
    kernels compiled on this machine (get_warm_input)."""
    inputs = {"matrix": get_path("matrix", matrix=wildcards.matrix)}
    if is_transpose_needed(wildcards.matrix):
        inputs["transpose"] = get_path("transpose", matrix=wildcards.matrix)
    return {**inputs, **get_warm_input()}


# ------------------------------------------------------------ kernels compiled once


def is_warm_enabled():
    """True when a GPU job runs (a cuda run, the benchmark, the convergence
    study on a GPU): warm_kernels compiles their kernels first, once."""
    if not is_gpu_enabled():
        return False
    cuda_runs = any(run["backend"] == "cuda" for run in get_runs())
    return is_bench_enabled() or cuda_runs or is_cuda_study()


#: Host memory warm_kernels asks for (MB): CuPy, a small matrix, a Numba process.
WARM_MEM_MB = 4000


def get_warm_threads(wildcards=None):
    """Host threads warm_kernels counts: none on one machine, where it runs
    beside the matrix's generation (which holds every core; the compilers
    take a core or so for some seconds), one under a cluster scheduler."""
    return 1 if workflow.non_local_exec else 0


def get_warm_input():
    """Input "warm" of a GPU job: warm_kernels' record, as ancient (the jobs
    wait for the compilation, and a later one does not make them stale)."""
    return {"warm": ancient(PATHS["warm"])} if is_warm_enabled() else {}


def get_warm_params(wildcards=None):
    """What warm_kernels compiles and runs on its small matrix: the cuda runs'
    (and a GPU convergence study's) kernel choices in each matrix format, OSEM
    where a run or the study has S > 1, the background term where a
    measurement has one, what the benchmark adds."""
    runs = [
        {
            k: run[k]
            for k in ("backend", "fp", "bp", "secsize", "graph", "gpus", "layout")
        }
        for run in get_runs()
        if run["backend"] == "cuda"
    ]
    if is_cuda_study():  # the study's reconstructions: one GPU, as OSEM where S > 1
        study = config["convergence"]
        runs.append(
            {
                "backend": "cuda",
                "fp": study["fp"],
                "bp": study["bp"],
                "secsize": None,
                "graph": "auto",
                "gpus": 1,
                "layout": "local",
            }
        )
    subsets = max(
        [int(get_subsets())]
        + (config["convergence"]["subsets"] if is_cuda_study() else [])
    )
    formats = sorted({entry["format"] for entry in config["matrices"].values()})
    additive = "additive" in get_simulated_factor_roles() or any(
        measurement_files(spec).get("additive")
        for entry in config["matrices"].values()
        for spec in entry["measurements"].values()
    )
    return {
        "runs": runs,
        "formats": formats,
        "subsets": subsets,
        "background": bool(additive),
        "bench": bool(is_bench_enabled()),
        "reference": bool(config["mlem"]["reference"]),
    }


def get_bench_params(wildcards):
    """Repetitions, merge section sizes and matrix formats of bench_spmv."""
    return {
        "repeats": config["bench"]["repeats"],
        "secsizes": config["bench"]["secsizes"],
        "formats": config["bench"]["formats"],
    }


# ------------------------------------------------------------------ the jobs


Job = collections.namedtuple("Job", "rule wildcards output")
Job.__doc__ = """One job of the workflow: its rule, its wildcards (a dict) and its
main output's path (PATHS; whether it exists says whether the job is done)."""


def get_jobs():
    """Every job of this workflow but summarize, as Job, in DAG order matrix by
    matrix (warm_kernels, of no matrix, first). The one list of what runs: summarize's inputs (and so the targets
    of `all`) and the resource check (get_stage_needs) are taken from it; the
    jobs that nothing but another job reads (generate, convert, reorder, norm,
    chunks, measurements) follow from the rules' input functions, under the
    same predicates (is_reordered, is_chunks_needed, ...)."""
    jobs = []
    for matrix in get_matrices():

        def add(rule, pattern, **wildcards):
            wildcards = {"matrix": matrix, **wildcards}
            jobs.append(Job(rule, wildcards, pattern.format(**wildcards)))

        entry = config["matrices"][matrix]
        if entry["preset"] and entry["csr4"]:
            add("generate_matrix", PATHS["csr4"])
        if is_generated_direct(matrix):
            add("generate_container", get_converted_matrix())
        else:
            add("convert_matrix", get_converted_matrix())
        if is_reordered():
            add("reorder_matrix", PATHS["matrix"])
        if not all(
            get_norm_factors(Wildcards(matrix, d)) for d in get_measurements(matrix)
        ):
            add("compute_norm", PATHS["norm"])
        if is_transpose_needed(matrix):
            add("transpose_matrix", PATHS["transpose"])
        for method in get_compared_transpose_methods():
            add("compare_transpose", PATHS["compared_transpose"], method=method)
        for parts in get_part_counts():
            add("partition_matrix", PATHS["plan"], parts=parts)
        if is_chunks_needed():
            add("chunk_matrix", PATHS["chunks"])
        for data in get_simulated_measurements():
            add("simulate_measurement", PATHS["sino"], data=data)
        for data in get_measurements(matrix):
            key = get_run_key()
            if is_modelled():
                key["model"] = get_model(matrix, data)
            ref_key = {k: key[k] for k in key if k in ("iterations", "model")}
            factors = get_norm_factors(Wildcards(matrix, data))
            if factors:
                add(
                    "compute_measurement_norm",
                    PATHS["measurement_norm"],
                    data=data,
                    factors=factors,
                )
            if is_reference_enabled():
                add("reference_mlem", PATHS["reference_image"], data=data, **ref_key)
                # the lossless file is not grouped by subset: no exact reference with subsets
                if get_exact_source(matrix) and not is_subsetted():
                    add(
                        "exact_reference_mlem",
                        PATHS["exact_reference_image"],
                        data=data,
                        **ref_key,
                    )
            for run in get_runs():
                add(
                    "run_mlem",
                    PATHS["run_image"],
                    data=data,
                    run=run["name"],
                    gpus=run["gpus"],
                    layout=run["layout"],
                    **key,
                )
        if is_convergence_enabled():
            for data in get_simulated_measurements():
                add("study_convergence", PATHS["convergence"], data=data)
        if is_bench_enabled():
            add("bench_spmv", PATHS["bench_csv"])
    if is_warm_enabled():  # one per configuration, of no matrix
        jobs.insert(0, Job("warm_kernels", {}, PATHS["warm"]))
    return jobs


def _outputs(jobs, rule, name):
    """PATHS[name] of every job of `rule` among `jobs`."""
    return [get_path(name, **job.wildcards) for job in jobs if job.rule == rule]


def get_summary_input(wildcards):
    """Named inputs of summarize: lists of every stage's records (get_jobs)."""
    jobs = get_jobs()
    return {
        "timings": _outputs(jobs, "run_mlem", "run_timings"),
        "plans": _outputs(jobs, "partition_matrix", "plan"),
        "transposes": _outputs(jobs, "transpose_matrix", "transpose")
        + _outputs(jobs, "compare_transpose", "compared_transpose"),
        "transpose_benchmarks": _outputs(
            jobs, "transpose_matrix", "transpose_benchmark"
        )
        + _outputs(jobs, "compare_transpose", "compared_transpose_benchmark"),
        # Their timings (rows of their own) and images (each run's accuracy
        # against its reference is joined here, mlemlib.report.summarize).
        "references": _outputs(jobs, "reference_mlem", "reference_timings")
        + _outputs(jobs, "reference_mlem", "reference_image"),
        "exact_references": _outputs(
            jobs, "exact_reference_mlem", "exact_reference_image"
        ),
        "bench": _outputs(jobs, "bench_spmv", "bench_csv"),
        "convergence": _outputs(jobs, "study_convergence", "convergence"),
    }


def get_final_outputs():
    """Targets of `all`: the summary tables and plots (they pull in every stage)."""
    return [
        PATHS[name]
        for name in (
            "runs_csv",
            "convergence_csv",
            "summary_md",
            "summary_html",
            "runs_html",
            "plots",
        )
    ]


# ------------------------------------------------------------ job resources
# Host memory (mem_mb) and wall-clock limit (runtime, minutes) of each job,
# from mlemlib.cluster's model of the stage, sized from the matrix's header;
# the SLURM profile turns them into sbatch options. Until the matrix exists
# (a dry run) they read <TBD>.


def _job_resources(stage, wildcards, input, threads, attempt):
    """mlemlib.cluster.stage_resources of one job of `stage`."""
    from mlemlib.cluster import matrix_size, stage_resources

    options = {"threads": threads, "attempt": attempt}
    if stage == "generate":
        # No input: the preset's recorded size (mlemlib.cluster.preset_size).
        return stage_resources(stage, _matrix_size_of(wildcards.matrix), **options)
    path = input.matrix if "matrix" in input.keys() else input.source
    if not os.path.exists(path):
        # Snakemake defers the resource until its input exists.
        raise FileNotFoundError(errno.ENOENT, "not made yet", path)
    if stage == "partition":
        options["parts"] = int(wildcards.parts)
        options["stored_transpose"] = is_local_transpose(
            int(wildcards.parts), wildcards.matrix
        )
    elif stage == "mlem":
        options.update(iterations=int(wildcards.iterations), backend="cpu")
        options["stored_transpose"] = "transpose" in input.keys()
        if "run" in wildcards.keys():
            run = get_run(wildcards)
            options.update(
                backend=run["backend"],
                gpus=run["gpus"],
                parts=run["gpus"],
                repetitions=int(wildcards.repetitions),
                source_format=config["matrices"][wildcards.matrix]["format"],
            )
    elif stage == "bench":
        options.update(backend="cuda", gpus=1, repetitions=config["bench"]["repeats"])
    return stage_resources(stage, matrix_size(path), **options)


def get_mem_mb(stage):
    """Resource function of `stage`: host memory to ask for (MB)."""

    def mem_mb(wildcards, input, threads, attempt):
        return _job_resources(stage, wildcards, input, threads, attempt)["mem_mb"]

    return mem_mb


def get_runtime(stage):
    """Resource function of `stage`: wall-clock limit to ask for (minutes)."""

    def runtime(wildcards, input, threads, attempt):
        return _job_resources(stage, wildcards, input, threads, attempt)["runtime"]

    return runtime


# ------------------------------------------------------------ what each stage needs
# Before any job runs: every job's disk, host memory and GPU memory, from the
# matrix's header (or the preset's recorded size before it exists), logged as
# a table; a run the node (config node:) or --resources cannot hold stops here
# with one line naming the stage and the shortfall.


def _matrix_size_of(matrix):
    """Size of `matrix`: its container's header, the user's file's, or the preset's estimate."""
    from mlemlib.cluster import matrix_size, preset_size

    entry = config["matrices"][matrix]
    made = Path(get_path("matrix", matrix=matrix))
    if made.exists():
        return matrix_size(made)
    if entry["path"] is not None:
        return matrix_size(entry["path"])
    return preset_size(entry["preset"], fold=bool(entry["fold"]))


def _device_format(matrix):
    """The format the GPUs hold: the container's where the registry has kernels for it, else csr."""
    from mlemlib import registry

    fmt = config["matrices"][matrix]["format"]
    return fmt if fmt in registry.FORMATS else "csr"


def _stage_need(job, size):
    """mlemlib.cluster.StageNeed of one Job: its rule's resource model (the
    stage its get_mem_mb names), the bytes it writes, its label in the table;
    None for a job the check does not size."""
    from mlemlib.cluster import SMALL_FILE_BYTES, matrix_bytes, stage_need

    name, wc = job.rule, job.wildcards
    matrix = wc["matrix"]
    fmt = config["matrices"][matrix]["format"]
    cores = workflow.cores or 1
    csr_t = size.csr_t_bytes
    kw = {}
    if name == "generate_matrix":
        stage, label, disk, kw = "generate", matrix, size.csr_bytes, {"threads": cores}
    elif name == "generate_container":
        stage, label, disk = "generate", f"{matrix}, {fmt}", matrix_bytes(size, fmt)
        kw = {"threads": cores}
    elif name == "convert_matrix":
        stage, label, disk = "convert", f"{matrix}, {fmt}", matrix_bytes(size, fmt)
    elif name == "reorder_matrix":
        stage, label, disk = "transpose", matrix, size.csr_bytes
    elif name == "compute_norm":
        subsets = get_subsets() if is_subsetted() else 0
        stage, label, disk = "norm", matrix, 8 * size.cols * (1 + subsets)
    elif name == "compute_measurement_norm":
        stage, label = "norm", f"{matrix}, {wc['data']}"
        disk = 8 * size.cols * (1 + get_subsets())
    elif name == "transpose_matrix":
        stage, label, disk, kw = "transpose", matrix, csr_t, {"threads": cores}
    elif name == "compare_transpose":
        stage, label, disk = "transpose", f"{matrix}, {wc['method']}", csr_t
        kw = {"threads": cores}
    elif name == "partition_matrix":
        local = is_local_transpose(wc["parts"], matrix)
        stage = "partition"
        label = f"{matrix}, {wc['parts']} parts" + (", A_k^T" if local else "")
        disk = SMALL_FILE_BYTES + (csr_t if local else 0)
        kw = {"parts": wc["parts"], "stored_transpose": local}
    elif name == "chunk_matrix":
        # sized like a conversion (rule chunk_matrix); about 7 bytes per non-zero written
        stage, label, disk = "convert", matrix, 7 * size.nnz + 8 * size.rows
    elif name == "simulate_measurement":
        stage, label = "simulate", f"{matrix}, {wc['data']}"
        disk = 4 * size.rows * (1 + len(get_simulated_factor_roles())) + 4 * size.cols
    elif name == "reference_mlem":
        stage, label, disk = "mlem", f"{matrix}, {wc['data']}", 8 * size.cols
        kw = {"stored_transpose": False}
    elif name == "run_mlem":
        run = _all_runs()[(wc["run"], wc["gpus"], wc["layout"])]
        device = "GPU" if run["backend"] == "cuda" else "CPU"
        label = f"{matrix}, {wc['data']}, {run['name']} on {run['gpus']} {device}"
        if run["gpus"] > 1:
            label += f"s, {run['layout']}"
        stage, disk = "mlem", 12 * size.cols
        kw = {
            "backend": run["backend"],
            "gpus": run["gpus"],
            "parts": run["gpus"],
            # A^T on the GPUs whether read from transpose.h5, from the partition's
            # part files or transposed there: the back projection holds it
            "stored_transpose": uses_transpose(run["backend"], run["bp"]),
            "device_format": _device_format(matrix),
            "source_format": fmt,
        }
    elif name == "bench_spmv":
        stage, label, disk = "bench", matrix, SMALL_FILE_BYTES
        kw = {"backend": "cuda", "gpus": 1}
    elif name == "study_convergence":
        # one grouped copy of the matrix at a time (removed at the end), then
        # reconstructions sized like a run on one GPU (backend cuda) or the CPU
        backend = config["convergence"]["backend"]
        stage, label = "mlem", f"{matrix}, {wc['data']}, convergence on {backend}"
        disk = matrix_bytes(size, fmt)
        kw = {
            "backend": backend,
            "gpus": 1,
            "parts": 1,
            "stored_transpose": False,
            "device_format": _device_format(matrix),
            "source_format": fmt,
        }
    else:
        # exact_reference_mlem reads the lossless source, whose size is not modelled here
        return None
    done = os.path.exists(job.output)
    return stage_need(stage, name, label, size, disk_bytes=disk, done=done, **kw)


def get_stage_needs():
    """Every job of get_jobs() as mlemlib.cluster.StageNeed, in DAG order."""
    sizes = {matrix: _matrix_size_of(matrix) for matrix in get_matrices()}
    needs = (
        (
            _stage_need(job, sizes[job.wildcards["matrix"]])
            if "matrix" in job.wildcards
            else _warm_need(job)
        )
        for job in get_jobs()
    )
    return [need for need in needs if need is not None]


def _warm_need(job):
    """warm_kernels' StageNeed: a small matrix on one GPU, its rule's mem_mb."""
    from mlemlib.cluster import BASE_MB, GPU_BASE_MB, SMALL_FILE_BYTES, StageNeed

    mb = 1 << 20
    return StageNeed(
        stage=job.rule,
        label="this machine's kernels",
        disk_bytes=SMALL_FILE_BYTES,
        host_bytes=(BASE_MB + GPU_BASE_MB) * mb,
        gpu_bytes=GPU_BASE_MB * mb,
        gpus=1,
        mem_mb=WARM_MEM_MB,
        done=os.path.exists(job.output),
    )


def check_resources():
    """Log every job's needs and the node's limits; stop on a shortfall (config node:).

    Skipped inside jobs (Snakemake parses the workflow again there).
    """
    from mlemlib.cluster import detect_node, needs_table, shortfalls

    if workflow.remote_exec or workflow.subprocess_exec:
        return
    node_cfg = config["node"]
    node = detect_node(
        ".",
        host_memory_gb=node_cfg["host_memory_gb"],
        gpu_memory_gb=node_cfg["gpu_memory_gb"],
        gpus=node_cfg["gpus"],
        disk_free_gb=node_cfg["disk_free_gb"],
        slurm_mem_mb=_global_resource("mem_mb"),
        slurm_gpus=_global_resource("gpu"),
    )
    needs = get_stage_needs()
    logger.info(
        "what each job needs (mlemlib.cluster; docs/cluster.md):\n"
        + needs_table(needs, node)
    )
    faults = shortfalls(needs, node, scheduler=workflow.non_local_exec)
    if faults and node_cfg["check"]:
        stop(f"resources: {faults[0]}")
    for fault in faults:
        logger.warning(f"resources (not checked, node.check: false): {fault}")


report_left_out_runs()
check_resources()
