rule simulate_measurement:
    input:
        matrix=get_converted_matrix(),
    output:
        **get_simulation_outputs(),
        sino=PATHS["sino"],
        truth=PATHS["truth"],
    log:
        "logs/data/{matrix}-{data}.log",
    wildcard_constraints:
        data=get_simulated_data_regex(),
    priority: 2
    conda:
        "../envs/cpu.yaml"
    threads: get_half_threads
    resources:
        mem_mb=get_mem_mb("simulate"),
        disk_mb=get_disk_mb("simulate_measurement"),
        runtime=get_runtime("simulate"),
    params:
        simulation=get_simulation_params,
    script:
        "../scripts/simulate_measurement.py"
