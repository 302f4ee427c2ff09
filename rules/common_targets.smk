"""What the summary reads, and so the targets of `all`: every run's timings,
the references it measures the runs against, and the records of the stages it
tabulates (plans, transposes, the benchmark, the convergence study), expanded
over the config. The jobs that make them, and the jobs those read from
(generation, conversion, reordering, norms, chunks, measurements, the kernels
compiled once), follow from the rules' input functions: Snakemake builds the
DAG, nothing here lists jobs.
"""


def get_run_wildcards(matrix, data):
    """The wildcards of RUN_KEY for the runs of {matrix} x {data}: the mlem
    settings (get_run_key) and, where is_modelled, the model (get_model)."""
    key = get_run_key()
    if is_modelled():
        key["model"] = get_model(matrix, data)
    return key


def get_reference_wildcards(matrix, data):
    """The wildcards of REFERENCE_KEY (the iterations, and the model where named)."""
    key = get_run_wildcards(matrix, data)
    return {k: key[k] for k in ("iterations", "model") if k in key}


def get_problems():
    """Every problem reconstructed: (matrix, measurement), matrix by matrix."""
    return [
        (matrix, data) for matrix in get_matrices() for data in get_measurements(matrix)
    ]


def get_run_outputs(name):
    """PATHS[name] of every run (get_runs) of every problem."""
    runs = get_runs()
    per_problem = expand(
        PATHS[name],
        zip,
        run=[run["name"] for run in runs],
        gpus=[run["gpus"] for run in runs],
        layout=[run["layout"] for run in runs],
        allow_missing=True,
    )
    return [
        path
        for matrix, data in get_problems()
        for path in expand(
            per_problem, matrix=matrix, data=data, **get_run_wildcards(matrix, data)
        )
    ]


def get_reference_outputs(name, exact=False):
    """PATHS[name] of the float64 reference of every problem (is_reference_enabled);
    with `exact`, of the lossless source's reference where a matrix is stored
    lossy (get_exact_source; not with subsets, whose grouping the source lacks)."""
    if not is_reference_enabled() or (exact and is_subsetted()):
        return []
    return [
        get_path(
            name, matrix=matrix, data=data, **get_reference_wildcards(matrix, data)
        )
        for matrix, data in get_problems()
        if not exact or get_exact_source(matrix)
    ]


def get_transpose_outputs(name, compared):
    """PATHS[name] of transpose.h5 where some job reads it (is_transpose_needed),
    or of the compared methods' transposes (`compared`), matrix by matrix."""
    if compared:
        return expand(
            PATHS[name], matrix=get_matrices(), method=get_compared_transpose_methods()
        )
    return [
        get_path(name, matrix=matrix)
        for matrix in get_matrices()
        if is_transpose_needed(matrix)
    ]


#: Host memory summarize asks for (MB): the tables, the plots and one image at a
#: time; set here so that Snakemake's default (from the inputs' size) is not used.
SUMMARY_MEM_MB = 2000


def get_summary_input(wildcards):
    """Named inputs of summarize: lists of every stage's records it tabulates."""
    return {
        "timings": get_run_outputs("run_timings"),
        "plans": expand(PATHS["plan"], matrix=get_matrices(), parts=get_part_counts()),
        "transposes": get_transpose_outputs("transpose", False)
        + get_transpose_outputs("compared_transpose", True),
        "transpose_benchmarks": get_transpose_outputs("transpose_benchmark", False)
        + get_transpose_outputs("compared_transpose_benchmark", True),
        # Their timings (rows of their own) and images (each run's accuracy
        # against its reference is joined here, mlemlib.report.summarize).
        "references": get_reference_outputs("reference_timings")
        + get_reference_outputs("reference_image"),
        "exact_references": get_reference_outputs("exact_reference_image", exact=True),
        "bench": (
            expand(PATHS["bench_csv"], matrix=get_matrices())
            if is_bench_enabled()
            else []
        ),
        "convergence": (
            expand(
                PATHS["convergence"],
                matrix=get_matrices(),
                data=get_simulated_measurements(),
            )
            if is_convergence_enabled()
            else []
        ),
    }


def get_summary_name(wildcards):
    """The configuration's name (config name), which the summary's title shows.

    Snakemake evaluates every job's params once it has built the DAG, dry
    runs (quiet ones too) included, and summarize is in every DAG of the
    workflow's target: so this starts the check of the DAG against this
    machine (check_dag) before any job runs.
    """
    check_dag()
    return config["name"]


def get_convergence_table():
    """The summary's convergence.csv where the study runs; none without it
    (no header-only table)."""
    return PATHS["convergence_csv"] if is_convergence_enabled() else []


def get_final_outputs():
    """Targets of `all`: the summary tables and plots (they pull in every stage)."""
    return [
        PATHS[name]
        for name in (
            "runs_csv",
            "summary_md",
            "summary_html",
            "runs_html",
            "plots",
        )
    ] + ([get_convergence_table()] if is_convergence_enabled() else [])
