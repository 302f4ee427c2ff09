rule generate_matrix:
    output:
        matrix=PATHS["csr4"],
    log:
        "logs/matrix/{matrix}-generate.log",
    benchmark:
        "benchmarks/matrix/{matrix}-generate.tsv"
    wildcard_constraints:
        matrix=get_generated_matrix_regex(),
    conda:
        "../envs/cpu.yaml"
    threads: workflow.cores
    resources:
        mem_mb=get_mem_mb("generate"),
        disk_mb=get_disk_mb("generate_matrix"),
        runtime=get_runtime("generate"),
    params:
        preset=get_preset,
        format="csr",
        fold=False,
    script:
        "../scripts/generate_matrix.py"


# A preset with csr4: false: the generator streams the rows straight into the
# container (CSR or compressed), so a matrix near the disk's size is written
# once, and there is no convert_matrix job for it.
rule generate_container:
    output:
        matrix=get_converted_matrix(),
    log:
        "logs/matrix/{matrix}-generate.log",
    benchmark:
        "benchmarks/matrix/{matrix}-generate.tsv"
    wildcard_constraints:
        matrix=get_direct_matrix_regex(),
    conda:
        "../envs/cpu.yaml"
    threads: workflow.cores
    resources:
        mem_mb=get_mem_mb("generate"),
        disk_mb=get_disk_mb("generate_container"),
        runtime=get_runtime("generate"),
    params:
        preset=get_preset,
        format=get_matrix_format,
        fold=get_matrix_fold,
        voxel_order=get_voxel_order,
    script:
        "../scripts/generate_matrix.py"


# params.source is provenance, not read by the script: the source file's path,
# size and modification time, so that a config pointing at another file, or
# the file replaced by another (even an older one), reruns the conversion.
# params.geometry: the grid and voxel size the conversion records
# (matrices.<name>.grid, voxel_size; a prior needs the grid).
rule convert_matrix:
    input:
        source=get_matrix_source,
    output:
        matrix=get_converted_matrix(),
    log:
        "logs/matrix/{matrix}-convert.log",
    benchmark:
        "benchmarks/matrix/{matrix}-convert.tsv"
    wildcard_constraints:
        matrix=get_converted_matrix_regex(),
    conda:
        "../envs/cpu.yaml"
    resources:
        mem_mb=get_mem_mb("convert"),
        disk_mb=get_disk_mb("convert_matrix"),
        runtime=get_runtime("convert"),
    params:
        source=get_matrix_stamp,
        format=get_matrix_format,
        fold=get_matrix_fold,
        clip_negative=get_matrix_clip_negative,
        geometry=get_matrix_geometry,
    script:
        "../scripts/convert_matrix.py"
