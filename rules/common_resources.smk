"""Each job's resources, and the check of the DAG against this machine.

Host memory (mem_mb) and wall-clock limit (runtime, minutes) of each job come
from mlemlib.cluster's model of its stage, sized from the matrix's header; the
SLURM profile turns them into sbatch options. Until the matrix exists (a dry
run) they read <TBD>.

Before any job runs, check_dag sizes every job of the DAG Snakemake built
(disk, host memory, GPU memory, GPUs; from the matrix's header, or the
preset's recorded size before it exists), logs them as a table, and stops on
what this machine cannot do, in one line naming the setting or the stage and
the shortfall: a run the node (config node:) or --resources cannot hold, GPU
jobs with use_gpu: true where no GPU is visible.
"""

import errno

from snakemake.logging import logger

from mlemlib.registry import uses_transpose

# ------------------------------------------------------------ job resources


def _job_resources(stage, wildcards, input, threads, attempt):
    """mlemlib.cluster.stage_resources of one job of `stage`."""
    from mlemlib.cluster import matrix_size, stage_resources

    options = {"threads": threads, "attempt": attempt}
    if stage == "generate":
        # No input: the preset's recorded size (mlemlib.cluster.preset_size).
        return stage_resources(stage, _matrix_size_of(wildcards.matrix), **options)
    path = next((input[k] for k in ("matrix", "source") if k in input.keys()), None)
    if path is None or not os.path.exists(path):
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
    # a size, not a check: validate_paths checked the values (clip_negative lets negative ones pass)
    return stage_resources(stage, matrix_size(path, allow_negative=True), **options)


def get_mem_mb(stage):
    """Resource function of `stage`: host memory to ask for (MB)."""

    def mem_mb(wildcards, input, threads, attempt):
        check_dag()
        return _job_resources(stage, wildcards, input, threads, attempt)["mem_mb"]

    return mem_mb


def get_runtime(stage):
    """Resource function of `stage`: wall-clock limit to ask for (minutes)."""

    def runtime(wildcards, input, threads, attempt):
        check_dag()
        return _job_resources(stage, wildcards, input, threads, attempt)["runtime"]

    return runtime


def get_disk_mb(rule_name):
    """Resource function of the jobs of `rule_name`: the disk each writes (MB), as the
    resource check models it (_stage_need; 1 for a job it does not size).

    It replaces Snakemake's default (twice the size of the input), whose
    evaluation while --report builds the report left a coroutine of
    Snakemake's never awaited (a RuntimeWarning no user could act on).
    """

    def disk_mb(wildcards, attempt):
        check_dag()
        wc = dict(wildcards.items())
        for key in ("parts", "gpus"):
            if key in wc:
                wc[key] = int(wc[key])
        if rule_name == "warm_kernels":
            need = _warm_need(False)
        elif "matrix" in wc:
            need = _stage_need(rule_name, wc, _matrix_size_of(wc["matrix"]), False)
        else:
            need = None
        return max(1, -(-need.disk_bytes // 10**6)) if need is not None else 1

    return disk_mb


# ------------------------------------------------------ what each job needs


def _matrix_size_of(matrix):
    """Size of `matrix`: its container's header, the user's file's, or the preset's estimate."""
    from mlemlib.cluster import matrix_size, preset_size

    entry = config["matrices"][matrix]
    made = Path(get_path("matrix", matrix=matrix))
    if made.exists():
        return matrix_size(made)
    if entry["path"] is not None:
        # a size, not a check (see _job_resources)
        return matrix_size(entry["path"], allow_negative=True)
    return preset_size(entry["preset"], fold=bool(entry["fold"]))


def _device_format(matrix):
    """The format the GPUs hold: the container's where the registry has kernels for it, else csr."""
    from mlemlib import registry

    fmt = config["matrices"][matrix]["format"]
    return fmt if fmt in registry.FORMATS else "csr"


def _stage_need(name, wc, size, done):
    """mlemlib.cluster.StageNeed of one job of rule `name` with wildcards `wc`
    (a dict, numbers as int): its rule's resource model (the stage its
    get_mem_mb names), the bytes it writes, its label in the table; None for
    a job the check does not size."""
    from mlemlib.cluster import SMALL_FILE_BYTES, matrix_bytes, stage_need

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
    elif name in ("reference_mlem", "compute_converged_map"):
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
    return stage_need(stage, name, label, size, disk_bytes=disk, done=done, **kw)


def _warm_need(done):
    """warm_kernels' StageNeed: a small matrix on one GPU, its rule's mem_mb."""
    from mlemlib.cluster import BASE_MB, GPU_BASE_MB, SMALL_FILE_BYTES, StageNeed

    mb = 1 << 20
    return StageNeed(
        stage="warm_kernels",
        label="this machine's kernels",
        disk_bytes=SMALL_FILE_BYTES,
        host_bytes=(BASE_MB + GPU_BASE_MB) * mb,
        gpu_bytes=GPU_BASE_MB * mb,
        gpus=1,
        mem_mb=WARM_MEM_MB,
        done=done,
    )


def _job_wildcards(job):
    """A Snakemake job's wildcards as a dict, the counts (parts, gpus) as int."""
    wc = dict(job.wildcards_dict)
    for key in ("parts", "gpus"):
        if key in wc:
            wc[key] = int(wc[key])
    return wc


def _is_done(job):
    """True when every output of a Snakemake job exists (it writes nothing new)."""
    return all(os.path.exists(path) for path in job.output)


def _job_order(dag):
    """Sort key of the DAG's jobs: matrix by matrix (the configuration's
    order; jobs of no matrix first), then in the DAG's order (its levels from
    the jobs without inputs), then by rule and by the configuration's order of
    measurements, methods and runs."""
    levels = {job: i for i, level in enumerate(dag.toposorted()) for job in level}
    rules = [rule.name for rule in workflow.rules]
    matrices = get_matrices()
    runs = [name for name, _, _ in _all_runs()]

    def key(job):
        wc = _job_wildcards(job)
        matrix = wc.get("matrix")
        order = [
            matrices.index(matrix) if matrix in matrices else -1,
            levels.get(job, 0),
            rules.index(job.rule.name) if job.rule.name in rules else len(rules),
        ]
        if matrix in matrices and "data" in wc:
            data = get_measurements(matrix)
            order.append(data.index(wc["data"]) if wc["data"] in data else len(data))
        if "run" in wc:
            order.append(runs.index(wc["run"]) if wc["run"] in runs else len(runs))
        order += [wc.get("gpus", 0), wc.get("parts", 0), str(sorted(wc.items()))]
        return order

    return key


def get_dag_needs(dag):
    """Every job of Snakemake's DAG as mlemlib.cluster.StageNeed, in _job_order."""
    sizes = {matrix: _matrix_size_of(matrix) for matrix in get_matrices()}
    needs = []
    for job in sorted(dag.jobs, key=_job_order(dag)):
        wc = _job_wildcards(job)
        if job.rule.name == "warm_kernels":
            need = _warm_need(_is_done(job))
        elif wc.get("matrix") in sizes:
            need = _stage_need(job.rule.name, wc, sizes[wc["matrix"]], _is_done(job))
        else:
            need = None
        if need is not None:
            needs.append(need)
    return needs


def check_gpus_visible(needs):
    """Stop where use_gpu: true brings GPU jobs to run on this machine and it
    has no GPU (get_visible_gpus): no --resources gpu=N, no cluster executor
    (whose GPUs are on the compute nodes, where the jobs run)."""
    if not is_gpu_forced() or is_cluster_execution():
        return
    if get_global_resource("gpu") is not None:
        return
    todo = [need for need in needs if need.gpus and not need.done]
    if not todo or get_visible_gpus() > 0:
        return
    stop(
        f"config use_gpu: true, but no GPU is visible here for the {len(todo)} GPU "
        f"jobs to run (the first: {todo[0].stage}, {todo[0].label}); run them where "
        "the GPUs are (a cluster profile: --profile profiles/slurm), give "
        "--resources gpu=N, or set use_gpu: auto"
    )


def check_resources(needs):
    """Log every job's needs and the node's limits; stop on a shortfall (config node:)."""
    from mlemlib.cluster import detect_node, needs_table, shortfalls

    node_cfg = config["node"]
    node = detect_node(
        ".",
        host_memory_gb=node_cfg["host_memory_gb"],
        gpu_memory_gb=node_cfg["gpu_memory_gb"],
        gpus=node_cfg["gpus"],
        disk_free_gb=node_cfg["disk_free_gb"],
        slurm_mem_mb=get_global_resource("mem_mb"),
        slurm_gpus=get_global_resource("gpu"),
    )
    logger.info(
        "what each job needs (mlemlib.cluster; docs/cluster.md):\n"
        + needs_table(needs, node)
    )
    faults = shortfalls(needs, node, scheduler=is_cluster_execution())
    if faults and node_cfg["check"]:
        stop(f"resources: {faults[0]}")
    for fault in faults:
        logger.warning(f"resources (not checked, node.check: false): {fault}")


#: Whether check_dag has run in this process (it runs once).
DAG_CHECKED = []


def check_dag():
    """Check the DAG Snakemake built against this machine, once, before any job.

    Snakemake evaluates every job's params once it has built the DAG (dry
    runs, quiet ones too, included), before it decides what to run: the
    params of the DAG's first jobs (generate_matrix, generate_container,
    convert_matrix: get_preset, get_matrix_stamp) and of its last
    (summarize: get_summary_name) start this check, so that a refusal is one
    line. The resource functions (evaluated before a job runs) call it too. Logs the runs get_gpu_limit() leaves out
    (report_left_out_runs), refuses GPU jobs without a GPU
    (check_gpus_visible), logs every job's needs and refuses a shortfall
    (check_resources). Skipped inside jobs (Snakemake parses the workflow
    again there) and where nothing is executed (--unlock, --lint, --report,
    --summary: no executor).
    """
    if DAG_CHECKED or workflow.remote_exec or workflow.subprocess_exec:
        return
    dag = getattr(workflow, "dag", None)
    if workflow.executor_plugin is None or dag is None or not dag.targetjobs:
        return
    DAG_CHECKED.append(True)
    report_left_out_runs()
    needs = get_dag_needs(dag)
    check_gpus_visible(needs)
    check_resources(needs)
