# The convergence study (config convergence; off by default) of one simulated
# measurement: MLEM and OSEM with each subset count of convergence.subsets,
# every one for the same passes, their contrast recovery and relative error
# against the phantom recorded per pass, and the same data reconstructed with
# m = 1 and b = 0. One job: each S groups the user's rows itself, in a scratch
# file removed at the end; the summary tabulates and plots the record.
rule study_convergence:
    input:
        unpack(get_convergence_input),
        warm=get_study_warm_record,
    output:
        record=PATHS["convergence"],
    log:
        f"logs/convergence/{{matrix}}/{{data}}/{CONVERGENCE_KEY}.log",
    benchmark:
        f"benchmarks/convergence/{{matrix}}/{{data}}/{CONVERGENCE_KEY}.tsv"
    wildcard_constraints:
        data=get_simulated_data_regex(),
    conda:
        "../envs/gpu.yaml"
    threads: workflow.cores
    # Sized like the reorder stage: each S writes the matrix grouped by its subsets once.
    resources:
        mem_mb=get_mem_mb("transpose"),
        disk_mb=get_disk_mb("study_convergence"),
        runtime=get_runtime("transpose"),
        gpu=get_convergence_gpus,
    params:
        study=get_convergence_params,
        matrix_name="{matrix}",
    script:
        "../scripts/study_convergence.py"
