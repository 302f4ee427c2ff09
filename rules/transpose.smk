rule transpose_matrix:
    input:
        matrix=PATHS["matrix"],
    output:
        transpose=PATHS["transpose"],
    log:
        "logs/transpose/{matrix}.log",
    benchmark:
        PATHS["transpose_benchmark"]
    conda:
        "../envs/gpu.yaml"
    threads: workflow.cores
    resources:
        mem_mb=get_mem_mb("transpose"),
        disk_mb=get_disk_mb("transpose_matrix"),
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
        matrix=PATHS["matrix"],
    output:
        transpose=PATHS["compared_transpose"],
    log:
        "logs/transpose/{matrix}-{method}.log",
    benchmark:
        PATHS["compared_transpose_benchmark"]
    conda:
        "../envs/gpu.yaml"
    threads: workflow.cores
    resources:
        mem_mb=get_mem_mb("transpose"),
        disk_mb=get_disk_mb("compare_transpose"),
        runtime=get_runtime("transpose"),
        gpu=get_transpose_gpus,
    params:
        method="{method}",
    script:
        "../scripts/transpose_matrix.py"
