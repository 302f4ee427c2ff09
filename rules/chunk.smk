# The row chunks of the chunked one pass (onepass_chunked), built once per
# matrix into results/{matrix}/chunks.h5 (mlemlib.chunked.write_layout, the
# arrays the GPUs hold), not in every run: a cuda run whose kernel reads
# chunks loads them (one GPU: all; N GPUs: an nnz-balanced range of them
# each). Made only where such a run exists (is_chunks_needed).
rule chunk_matrix:
    input:
        matrix=PATHS["matrix"],
    output:
        chunks=PATHS["chunks"],
    log:
        "logs/chunk/{matrix}.log",
    benchmark:
        "benchmarks/chunk/{matrix}.tsv"
    conda:
        "../envs/cpu.yaml"
    threads: workflow.cores
    # Sized like a conversion: one block of rows in memory (and its layout),
    # the matrix read once and about 7 bytes per non-zero written.
    resources:
        mem_mb=get_mem_mb("convert"),
        disk_mb=get_disk_mb("chunk_matrix"),
        runtime=get_runtime("convert"),
    params:
        window=get_chunk_window(),
        chunk_cap=get_chunk_cap(),
    script:
        "../scripts/chunk_matrix.py"
