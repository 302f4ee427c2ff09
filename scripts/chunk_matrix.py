"""Rule chunk_matrix: the matrix's row chunks in the chunked one pass's layout (chunks.h5), built once."""

from mlemlib.logs import send_to_log

send_to_log(snakemake.log[0])

from mlemlib.chunked import write_layout  # noqa: E402

write_layout(
    snakemake.input.matrix,
    snakemake.output.chunks,
    snakemake.params.window,
    threads=snakemake.threads,
    chunk_cap=snakemake.params.chunk_cap,
).close()
