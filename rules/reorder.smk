# The locality permutation (config reorder: rows | rows+voxels), with OSEM
# subsets (mlem.subsets > 1) subset-major: each subset's rows together, in
# the locality order (the user's order for reorder: none) inside. The user's
# matrix, converted to results/{matrix}/converted.h5, is renumbered into
# results/{matrix}/matrix.h5, which norm, transpose, partition, the runs and the
# benchmark read. simulate_measurement reads converted.h5 (the user's order),
# so the data do not depend on the setting. With reorder: none convert_matrix
# writes matrix.h5 itself and this rule does not exist (unless there are
# subsets). matrix.h5 keeps
# converted.h5's format (CSR or a compressed one).
if is_reordered():

    rule reorder_matrix:
        input:
            unpack(get_subset_input),
            matrix=PATHS["converted"],
        output:
            matrix=PATHS["matrix"],
        log:
            "logs/reorder/{matrix}.log",
        benchmark:
            "benchmarks/reorder/{matrix}.tsv"
        conda:
            "../envs/cpu.yaml"
        threads: workflow.cores
        # Sized like a transposition: one copy of the matrix in memory plus a
        # chunk, the matrix read and written once.
        resources:
            mem_mb=get_mem_mb("transpose"),
            disk_mb=get_disk_mb("reorder_matrix"),
            runtime=get_runtime("transpose"),
        params:
            mode=get_reorder_mode,
            subsets=get_subsets,
        script:
            "../scripts/reorder_matrix.py"
