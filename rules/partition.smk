rule partition_matrix:
    input:
        matrix="results/{matrix}/matrix.h5",
        transpose="results/{matrix}/transpose.h5",
    output:
        plan="results/{matrix}/parts-{parts}/plan.json",
    log:
        "logs/partition/{matrix}-parts-{parts}.log",
    benchmark:
        "benchmarks/partition/{matrix}-parts-{parts}.tsv"
    conda:
        "../envs/cpu.yaml"
    threads: workflow.cores
    resources:
        mem_mb=get_mem_mb("partition"),
        runtime=get_runtime("partition"),
    params:
        parts=get_parts,
    script:
        "../scripts/partition_matrix.py"
