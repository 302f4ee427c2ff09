"""The measurements (simulated or the user's, with their factors m and b),
the model each reconstruction names, the reconstructions' inputs and params,
the SpMV benchmark, the GPU jobs' kernels compiled once (warm_kernels) and the
convergence study.
"""

import collections
import dataclasses
import hashlib

# ------------------------------------------------------------- measurements


def is_reference_enabled():
    """True when every problem gets a float64 CPU reference MLEM."""
    return bool(config["mlem"]["reference"])


def is_simulated(wildcards):
    """True when the measurement {data} is simulated (it has a ground truth)."""
    return wildcards.data not in get_user_measurements(wildcards.matrix)


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


def _factor_identity(wildcards, role):
    """8 hex digits that identify {data}'s factor file of `role` ("" without one):
    a user's file's contents (and dataset), or the simulation's settings."""
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


def get_model(matrix, data, map_settings=None):
    """{model} of the runs of {matrix} x {data} (is_modelled): mlem or osem{S},
    then _f, _m and _b with the identities of the subset file, m and b, then
    the MAP settings (get_map_model; `map_settings`: others than the runs')."""
    mlem = config["mlem"]
    wildcards = Wildcards(matrix=matrix, data=data)
    parts = [f"osem{mlem['subsets']}" if is_subsetted() else "mlem"]
    if mlem["subset_file"]:
        parts.append(f"f{_read_checked(mlem['subset_file'], file_digest)[:8]}")
    for role, letter in (("multiplicative", "m"), ("additive", "b")):
        identity = _factor_identity(wildcards, role)
        if identity:
            parts.append(letter + identity)
    if is_map():
        parts.append(get_map_model(map_settings or get_map_settings()))
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


# --------------------------------------------------------------- simulation


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


# ---------------------------------------------------------- reconstructions


def get_run_key():
    """The wildcards of RUN_KEY, from config mlem: the settings that define a run's outputs."""
    mlem = config["mlem"]
    return {k: mlem[k] for k in ("iterations", "repetitions", "checkpoint_every")}


def get_mlem_params(wildcards):
    """Iteration settings of a run, as its path names them (RUN_KEY), and its
    model: subsets, factor files, MAP (get_model), metrics (get_metrics_params)."""
    return {
        "iterations": int(wildcards.iterations),
        "checkpoint_every": int(wildcards.checkpoint_every),
        "repetitions": int(wildcards.repetitions),
        **get_model_params(wildcards),
        **get_metrics_params(wildcards),
    }


def get_reference_params(wildcards):
    """Iteration count of the float64 reference, as its path names it, and its model."""
    return {"iterations": int(wildcards.iterations), **get_model_params(wildcards)}


def get_model_params(wildcards):
    """What a reconstruction models beyond MLEM: subsets (S), the factor files
    (role -> file or FILE.h5:/dataset) of {data} and MAP (the reference of a
    MAP run: the same algorithm in float64)."""
    return {
        "subsets": get_subsets(),
        "factors": get_factor_specs(wildcards),
        **get_map_params(),
    }


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
    inputs.update(get_map_input())
    return inputs


def get_user_factor_files(wildcards):
    """The files of a user's m and b of {data} (role -> path; the params say which dataset)."""
    from mlemlib.corrections import split_h5

    if is_simulated(wildcards):
        return {}
    return {
        role: split_h5(spec)[0] for role, spec in get_factor_specs(wildcards).items()
    }


def get_exact_reference_input(wildcards):
    """Named inputs of exact_reference_mlem: the problem's, with the lossless
    source for the matrix and no norm (the source's own column sums)."""
    inputs = get_problem_input(wildcards)
    del inputs["norm"]
    inputs["matrix"] = get_exact_source(wildcards.matrix)
    return inputs


def get_mlem_input(wildcards):
    """Named inputs of run_mlem: the problem, plus transpose, plan and chunks as
    needed (the kernels compiled once: get_run_warm_record). Not the float64 reference: no run waits for it; the summary
    measures every run against it (get_summary_input)."""
    run = get_run(wildcards)
    inputs = get_problem_input(wildcards)
    matrix = wildcards.matrix
    if run_reads_transpose(run, matrix):
        inputs["transpose"] = get_path("transpose", matrix=matrix)
    if run_reads_plan(run, matrix):
        inputs["plan"] = get_path("plan", matrix=matrix, parts=run["gpus"])
    if is_chunked_run(run):
        inputs["chunks"] = get_path("chunks", matrix=matrix)
    inputs.update(get_converged_input(wildcards))
    return inputs


def get_checkpoint(wildcards):
    """Checkpoint file of a run (kept by an interrupted job so a rerun resumes)."""
    return get_path("run_checkpoint", **dict(wildcards.items()))


def get_mlem_gpus(wildcards):
    """GPUs a run occupies (the `gpu` resource): its GPU count for cuda, else 0."""
    run = get_run(wildcards)
    return run["gpus"] if run["backend"] == "cuda" else 0


# ---------------------------------------------------------------- benchmark


def is_bench_enabled():
    """True when the SpMV benchmark runs (it needs a GPU)."""
    return config["bench"]["spmv"] and is_gpu_enabled()


def get_bench_input(wildcards):
    """Named inputs of bench_spmv: the matrix, and transpose.h5 where the
    workflow makes it anyway (else the benchmark transposes on its GPU)."""
    inputs = {"matrix": get_path("matrix", matrix=wildcards.matrix)}
    if is_transpose_needed(wildcards.matrix):
        inputs["transpose"] = get_path("transpose", matrix=wildcards.matrix)
    return inputs


def get_bench_params(wildcards):
    """Repetitions, merge section sizes and matrix formats of bench_spmv."""
    return {
        "repeats": config["bench"]["repeats"],
        "secsizes": config["bench"]["secsizes"],
        "formats": config["bench"]["formats"],
    }


# ---------------------------------------------------- kernels compiled once


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


def get_warm_record(wildcards=None):
    """Input "warm" of a GPU job: warm_kernels' record, so that the job waits
    for the compilation; empty where no GPU job runs (is_warm_enabled).

    Through the checkpoint warm_kernels: where it still has to run (its
    record missing, or its params changed with the configured runs), Snakemake
    looks at the GPU jobs again once it has run, and so runs every one that is
    missing then. With the record as a plain rule's output, a warm-up to rerun
    hid the GPU jobs to make: Snakemake skipped them (ancient inputs of a job
    it reruns), ran the warm-up alone and reported success. The record is
    ancient: a later warm-up does not make the finished jobs stale.
    """
    if not is_warm_enabled():
        return []
    return ancient(checkpoints.warm_kernels.get().output.warm)


def get_run_warm_record(wildcards):
    """Input "warm" of run_mlem: warm_kernels' record for a cuda run (get_warm_record), none for a cpu run."""
    return get_warm_record() if get_run(wildcards)["backend"] == "cuda" else []


def get_study_warm_record(wildcards):
    """Input "warm" of study_convergence: warm_kernels' record for a study on the GPU."""
    return get_warm_record() if is_cuda_study() else []


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


# -------------------------------------------------------------- convergence


def is_convergence_enabled():
    """True when the convergence study runs (config convergence.enabled; with
    backend cuda only where cuda runs are let in, use_gpu)."""
    study = config["convergence"]
    return study["enabled"] and (study["backend"] == "cpu" or is_gpu_enabled())


def is_cuda_study():
    """True when the convergence study runs, on a GPU."""
    return is_convergence_enabled() and config["convergence"]["backend"] == "cuda"


def get_convergence_input(wildcards):
    """Named inputs of study_convergence: the matrix in the user's row order
    (each S groups its rows), the measurement, its truth and its m and b."""
    return {
        "matrix": get_converted_matrix().format(matrix=wildcards.matrix),
        "sino": get_path("sino", matrix=wildcards.matrix, data=wildcards.data),
        "truth": get_path("truth", matrix=wildcards.matrix, data=wildcards.data),
        **get_simulated_factors(wildcards),
    }


def get_convergence_gpus(wildcards):
    """GPUs a study_convergence job takes: 1 with backend cuda, else 0."""
    return 1 if config["convergence"]["backend"] == "cuda" else 0


def get_convergence_params(wildcards):
    """The study's settings (config convergence but enabled)."""
    return {k: v for k, v in config["convergence"].items() if k != "enabled"}
