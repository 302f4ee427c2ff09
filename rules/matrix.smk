rule generate_matrix:
    output:
        matrix="resources/{matrix}.csr4",
    log:
        "logs/matrix/{matrix}-generate.log",
    benchmark:
        "benchmarks/matrix/{matrix}-generate.tsv"
    wildcard_constraints:
        matrix=get_generated_matrix_regex(),
    conda:
        "../envs/cpu.yaml"
    threads: workflow.cores
    params:
        preset=get_preset,
    script:
        "../scripts/generate_matrix.py"


rule convert_matrix:
    input:
        source=get_matrix_source,
    output:
        matrix=get_converted_matrix(),
    log:
        "logs/matrix/{matrix}-convert.log",
    benchmark:
        "benchmarks/matrix/{matrix}-convert.tsv"
    conda:
        "../envs/cpu.yaml"
    resources:
        mem_mb=get_mem_mb("convert"),
        runtime=get_runtime("convert"),
    script:
        "../scripts/convert_matrix.py"
