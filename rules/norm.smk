rule compute_norm:
    input:
        matrix=PATHS["matrix"],
    output:
        norm=PATHS["norm"],
    log:
        "logs/norm/{matrix}.log",
    benchmark:
        "benchmarks/norm/{matrix}.tsv"
    conda:
        "../envs/cpu.yaml"
    threads: workflow.cores
    resources:
        mem_mb=get_mem_mb("norm"),
        runtime=get_runtime("norm"),
    script:
        "../scripts/compute_norm.py"
