"""The configured runs, expanded over GPU counts and layouts, the GPUs
this machine gives them (use_gpu, gpu_runs, node.gpus, --resources gpu=N),
the host threads of the jobs beside the GPU jobs, and each (matrix, run)
pair as the mlemlib.compose.Combination whose verdict
(compose.check) the dry run gives and whose reads (compose.reads_transpose)
its inputs follow.
"""

import functools
import importlib.util

from snakemake.logging import logger


def get_global_resource(name):
    """--resources name=N as an int; None where not given."""
    value = workflow.global_resources.get(name)
    value = getattr(value, "value", value)
    return int(value) if isinstance(value, (int, float)) else None


@functools.cache
def get_visible_gpus():
    """GPUs this process sees, counted without CUDA or CuPy: NVML, else the
    driver's /proc entries; $MLEM_NUM_GPUS where set; CUDA_VISIBLE_DEVICES
    respected (mlemlib.dist.lease.candidate_devices, what a GPU job leases)."""
    from mlemlib.dist.lease import candidate_devices

    try:
        return len(candidate_devices())
    except ConfigError as exc:
        stop(f"environment {exc}")


def is_cluster_execution():
    """True when the jobs run under a cluster executor (--executor slurm,
    --profile profiles/slurm), whose GPUs are on the compute nodes.

    A dry run swaps in Snakemake's dry-run executor, which runs locally, but
    keeps the threads setting a non-local executor implies (use_threads).
    """
    if workflow.non_local_exec:
        return True
    settings = getattr(workflow, "execution_settings", None)
    return bool(workflow.dryrun and settings is not None and settings.use_threads)


@functools.cache
def get_gpu_limits():
    """What caps a cuda run's GPU count here: {why: count}, empty for no cap.

    ``use_gpu: auto`` counts, once, the GPUs visible here (get_visible_gpus;
    0 where CuPy is not installed); ``false`` gives 0; ``true`` sets no cap of
    its own (a cluster whose login node has no GPU; on one machine,
    check_gpus_visible refuses it where no GPU is visible). With ``gpu_runs:
    fit`` (the default) the node's GPUs (``node.gpus``, where a number) and
    ``--resources gpu=N`` cap it too; ``gpu_runs: all`` keeps every run within
    use_gpu, and the resource check refuses one the node cannot give its GPUs.
    """
    limits = {}
    setting = config["use_gpu"]
    if setting in (False, "false"):
        limits["use_gpu: false (0)"] = 0
    elif setting not in (True, "true"):
        count = get_visible_gpus() if importlib.util.find_spec("cupy") else 0
        limits[f"use_gpu: auto ({count} visible here)"] = count
    if config["gpu_runs"] == "fit":
        if isinstance(config["node"]["gpus"], int):
            limits[f"node.gpus: {config['node']['gpus']}"] = config["node"]["gpus"]
        if get_global_resource("gpu") is not None:
            limits[f"--resources gpu={get_global_resource('gpu')}"] = (
                get_global_resource("gpu")
            )
    return limits


def get_gpu_limit():
    """Most GPUs a cuda run may use here (get_gpu_limits); None for no limit."""
    return min(get_gpu_limits().values(), default=None)


def is_gpu_enabled():
    """True when runs with backend cuda (and the SpMV benchmark) belong to the DAG."""
    limit = get_gpu_limit()
    return limit is None or limit > 0


def is_gpu_forced():
    """True for ``use_gpu: true``: every cuda run is kept without a GPU count here."""
    return config["use_gpu"] in (True, "true")


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


def expand_run(entry):
    """The runs of one config runs: entry, one per GPU count and (above one
    GPU) layout; one GPU has no layout to choose: its run is "local"."""
    return [
        {
            "name": _run_name(entry),
            "backend": entry["backend"],
            "fp": entry["fp"],
            "bp": entry["bp"],
            "secsize": entry["secsize"],
            "graph": entry["graph"],
            "gpus": gpus,
            "layout": layout,
        }
        for gpus in _as_list(entry["gpus"])
        for layout in (_as_list(entry["layout"]) if gpus > 1 else ["local"])
    ]


@functools.cache
def _all_runs():
    """Every configured run, expanded over GPU counts and layouts (cached)."""
    return {
        (run["name"], run["gpus"], run["layout"]): run
        for entry in config["runs"]
        for run in expand_run(entry)
    }


#: A run's graph setting (true, false, auto) as mlemlib.compose names it.
COMPOSE_GRAPHS = {True: "on", False: "off"}


def get_combination(run, matrix):
    """The mlemlib.compose.Combination of one run of `matrix`: the matrix's
    format, fold and the reorder stage, the config's subsets and factors (an
    additive background b: what the verdict looks at), the run's execution."""
    entry = config["matrices"][matrix]
    return compose.Combination(
        format=entry["format"],
        fold=bool(entry["fold"]),
        reorder=config["reorder"],
        subsets=config["mlem"]["subsets"],
        factors=is_background(),
        backend=run["backend"],
        fp=run["fp"],
        bp=run["bp"],
        gpus=run["gpus"],
        layout=run["layout"],
        graph=COMPOSE_GRAPHS.get(run["graph"], "auto"),
    )


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


# ------------------------------------------------- host threads beside the GPUs


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
