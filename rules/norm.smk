rule compute_norm:
    input:
        matrix=PATHS["matrix"],
    output:
        norm=PATHS["norm"],
    log:
        "logs/norm/{matrix}.log",
    benchmark:
        "benchmarks/norm/{matrix}.tsv"
    priority: 2
    conda:
        "../envs/cpu.yaml"
    threads: get_half_threads
    resources:
        mem_mb=get_mem_mb("norm"),
        disk_mb=get_disk_mb("compute_norm"),
        runtime=get_runtime("norm"),
    script:
        "../scripts/compute_norm.py"


# The sensitivities of one measurement with multiplicative factors m (the
# subsets' s^k weighted by m): every reconstruction of it reads this instead
# of norm.h5. {factors} names m's identity, so that other factors never
# share the file.
rule compute_measurement_norm:
    input:
        unpack(get_measurement_norm_input),
    output:
        norm=PATHS["measurement_norm"],
    log:
        "logs/norm/{matrix}-{data}-{factors}.log",
    benchmark:
        "benchmarks/norm/{matrix}-{data}-{factors}.tsv"
    conda:
        "../envs/cpu.yaml"
    threads: workflow.cores
    resources:
        mem_mb=get_mem_mb("norm"),
        disk_mb=get_disk_mb("compute_measurement_norm"),
        runtime=get_runtime("norm"),
    params:
        multiplicative=get_measurement_norm_params,
    script:
        "../scripts/compute_norm.py"
