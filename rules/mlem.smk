# The float64 CPU reference MLEM of one problem (matrix x measurement) after
# {iterations} iterations, which every run of that problem is measured against
# where the summary is made (no run waits for it). params.measurement (here
# and in run_mlem) is provenance, not read by the script: a user's
# measurement's path, size and mtime, so that replacing the file reruns the
# reconstructions.
rule reference_mlem:
    input:
        unpack(get_problem_input),
    output:
        image=PATHS["reference_image"],
        timings=PATHS["reference_timings"],
    log:
        f"logs/mlem/{{matrix}}/{{data}}/reference-{REFERENCE_KEY}.log",
    benchmark:
        f"benchmarks/mlem/{{matrix}}/{{data}}/reference-{REFERENCE_KEY}.tsv"
    conda:
        "../envs/cpu.yaml"
    threads: get_reference_threads
    resources:
        mem_mb=get_mem_mb("mlem"),
        disk_mb=get_disk_mb("reference_mlem"),
        runtime=get_runtime("mlem"),
    params:
        mlem=get_reference_params,
        measurement=get_measurement_stamp,
    script:
        "../scripts/reference_mlem.py"


# A matrix stored with lossy 16-bit values (format compressed-f16 or
# compressed-u16): the float64 reference MLEM of the same problem on the
# lossless file it was converted from (its own norm, in the user's order), so
# that the summary states what the rounded values cost every run's image.
rule exact_reference_mlem:
    input:
        unpack(get_exact_reference_input),
    output:
        image=PATHS["exact_reference_image"],
        timings=PATHS["exact_reference_timings"],
    log:
        f"logs/mlem/{{matrix}}/{{data}}/reference-exact-{REFERENCE_KEY}.log",
    benchmark:
        f"benchmarks/mlem/{{matrix}}/{{data}}/reference-exact-{REFERENCE_KEY}.tsv"
    conda:
        "../envs/cpu.yaml"
    threads: get_reference_threads
    resources:
        mem_mb=get_mem_mb("mlem"),
        disk_mb=get_disk_mb("exact_reference_mlem"),
        runtime=get_runtime("mlem"),
    params:
        mlem=get_reference_params,
        measurement=get_measurement_stamp,
    script:
        "../scripts/reference_mlem.py"


# The converged MAP image of a simulated measurement (mlem.prior set): BSREM
# with the configured prior for mlem.map_converged_passes passes on the float64
# reference path (mlemlib.map_metrics.converged_map), once per problem and
# prior; its path names the passes and the model of BSREM, so that runs of
# either algorithm share it. The MAP runs of the measurement measure their
# images against it (input converged of run_mlem) for the summary's time to
# threshold.
rule compute_converged_map:
    input:
        unpack(get_problem_input),
    output:
        image=PATHS["converged_image"],
    log:
        "logs/mlem/{matrix}/{data}/converged-it{iterations}-{model}.log",
    benchmark:
        "benchmarks/mlem/{matrix}/{data}/converged-it{iterations}-{model}.tsv"
    conda:
        "../envs/cpu.yaml"
    threads: get_reference_threads
    resources:
        mem_mb=get_mem_mb("mlem"),
        disk_mb=get_disk_mb("compute_converged_map"),
        runtime=get_runtime("mlem"),
    params:
        mlem=get_converged_params,
        measurement=get_measurement_stamp,
    script:
        "../scripts/compute_converged_map.py"


# One configured run with the mlem settings its path names (RUN_KEY in
# common.smk): its repetitions run inside this one job, so that they share the
# device and the loaded matrix; timings.json holds every one. A run
# whose kernel reads row chunks gets the matrix's chunks.h5 (chunk_matrix) as
# input "chunks" (get_mlem_input), which the script passes to reconstruct.
rule run_mlem:
    input:
        unpack(get_mlem_input),
        warm=get_run_warm_record,
    output:
        image=PATHS["run_image"],
        timings=PATHS["run_timings"],
        raw=PATHS["run_raw"],
    log:
        f"logs/mlem/{{matrix}}/{{data}}/{{run}}-{RUN_KEY}-gpus-{{gpus}}-{{layout}}.log",
    benchmark:
        f"benchmarks/mlem/{{matrix}}/{{data}}/{{run}}-{RUN_KEY}-gpus-{{gpus}}-{{layout}}.tsv"
    priority: 1
    conda:
        "../envs/gpu.yaml"
    threads: get_mlem_threads
    resources:
        mem_mb=get_mem_mb("mlem"),
        disk_mb=get_disk_mb("run_mlem"),
        runtime=get_runtime("mlem"),
        gpu=get_mlem_gpus,
    params:
        run=get_run,
        mlem=get_mlem_params,
        checkpoint=get_checkpoint,
        matrix_name="{matrix}",
        measurement=get_measurement_stamp,
    script:
        "../scripts/run_mlem.py"


# The GPU jobs' kernels compiled once on this machine (mlemlib.backends.warm):
# every build in background threads and each configured kernel choice run on a
# small matrix, so that CuPy's and Numba's caches hold them; it has no input
# and runs while the matrix is generated. A checkpoint: once it has run,
# Snakemake looks at the GPU jobs that wait for it again (get_warm_record), so
# that a warm-up rerun for changed params never hides the GPU jobs to make.
checkpoint warm_kernels:
    output:
        warm=PATHS["warm"],
    log:
        f"logs/kernels/{config['name']}.log",
    benchmark:
        f"benchmarks/kernels/{config['name']}.tsv"
    priority: 1
    conda:
        "../envs/gpu.yaml"
    threads: get_warm_threads
    resources:
        mem_mb=WARM_MEM_MB,
        disk_mb=get_disk_mb("warm_kernels"),
        runtime=15,
        gpu=1,
    params:
        warm=get_warm_params,
    script:
        "../scripts/warm_kernels.py"


# SpMV kernels against cuSPARSE on one matrix (only where a GPU is used).
rule bench_spmv:
    input:
        unpack(get_bench_input),
        warm=get_warm_record,
    output:
        csv=PATHS["bench_csv"],
        md=PATHS["bench_md"],
        json=PATHS["bench_json"],
    log:
        "logs/bench/{matrix}-spmv.log",
    benchmark:
        "benchmarks/bench/{matrix}-spmv.tsv"
    priority: 1
    conda:
        "../envs/gpu.yaml"
    threads: 1
    resources:
        mem_mb=get_mem_mb("bench"),
        disk_mb=get_disk_mb("bench_spmv"),
        runtime=get_runtime("bench"),
        gpu=1,
    params:
        bench=get_bench_params,
        matrix_name="{matrix}",
    script:
        "../scripts/bench_spmv.py"
