rule simulate_measurement:
    input:
        matrix=get_converted_matrix(),
    output:
        sino="results/{matrix}/data/{phantom}-seed{seed}.LMsino",
        truth="results/{matrix}/data/{phantom}-seed{seed}-truth.h5",
    log:
        "logs/data/{matrix}-{phantom}-seed{seed}.log",
    conda:
        "../envs/cpu.yaml"
    threads: workflow.cores
    resources:
        mem_mb=get_mem_mb("simulate"),
        runtime=get_runtime("simulate"),
    params:
        simulation=get_simulation_params,
    script:
        "../scripts/simulate_measurement.py"
