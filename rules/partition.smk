# plan.json references row ranges of matrix.h5 (nothing copied); transpose.h5 is
# read, and the parts' A_k^T written, only where a run of this part count needs them.
rule partition_matrix:
    input:
        unpack(get_partition_input),
    output:
        plan=PATHS["plan"],
    log:
        "logs/partition/{matrix}-parts-{parts}.log",
    benchmark:
        "benchmarks/partition/{matrix}-parts-{parts}.tsv"
    priority: 1
    conda:
        "../envs/cpu.yaml"
    threads: max(1, workflow.cores // 4)
    resources:
        mem_mb=get_mem_mb("partition"),
        disk_mb=get_disk_mb("partition_matrix"),
        runtime=get_runtime("partition"),
    params:
        parts=get_parts,
        local_transpose=get_local_transpose,
    script:
        "../scripts/partition_matrix.py"
