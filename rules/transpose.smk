rule transpose_matrix:
    input:
        matrix="results/{matrix}/matrix.h5",
    output:
        transpose="results/{matrix}/transpose.h5",
    log:
        "logs/transpose/{matrix}.log",
    benchmark:
        "benchmarks/transpose/{matrix}.tsv"
    conda:
        "../envs/gpu.yaml"
    threads: workflow.cores
    resources:
        mem_mb=get_mem_mb("transpose"),
        runtime=get_runtime("transpose"),
        gpu=get_transpose_gpus,
    params:
        method=get_transpose_method,
    script:
        "../scripts/transpose_matrix.py"


# The same transposition with another method, for the comparison table; the
# arrays equal transpose.h5's, only the timing differs.
rule compare_transpose:
    input:
        matrix="results/{matrix}/matrix.h5",
    output:
        transpose="results/{matrix}/transpose-{method}.h5",
    log:
        "logs/transpose/{matrix}-{method}.log",
    benchmark:
        "benchmarks/transpose/{matrix}-{method}.tsv"
    conda:
        "../envs/gpu.yaml"
    threads: workflow.cores
    resources:
        mem_mb=get_mem_mb("transpose"),
        runtime=get_runtime("transpose"),
        gpu=get_transpose_gpus,
    params:
        method="{method}",
    script:
        "../scripts/transpose_matrix.py"
