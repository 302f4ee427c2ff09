"""The matrix stages: which matrix files each matrix gets (generated,
converted, reordered), and which transposes, partitions and row chunks the
runs read.
"""

import functools

from mlemlib.compressed import LOSSY_FORMATS
from mlemlib.registry import get_bp

# ----------------------------------------------------------------- matrices


def get_matrices():
    """Names of the configured system matrices."""
    return list(config["matrices"])


def get_preset(wildcards):
    """Scanner preset of a generated matrix (and, as the params of a first
    job of the DAG, the start of check_dag)."""
    check_dag()
    return config["matrices"][wildcards.matrix]["preset"]


def get_matrix_source(wildcards):
    """The file convert_matrix reads: the user's file or the generated .csr4."""
    entry = config["matrices"][wildcards.matrix]
    if entry["path"] is not None:
        return entry["path"]
    return get_path("csr4", matrix=wildcards.matrix)


def get_matrix_stamp(wildcards):
    """Provenance of convert_matrix's source, a param so that any change reruns it.

    A user's file: its path, size and modification time, so that pointing
    the config at another file, or replacing the file with one of another
    size or time (even an older one), reruns the conversion and what follows.
    A generated matrix: its preset (generate_matrix's output is tracked by
    Snakemake itself). As the params of a first job of the DAG, it starts
    check_dag.
    """
    check_dag()
    entry = config["matrices"][wildcards.matrix]
    if entry["path"] is None:
        return {"preset": entry["preset"]}
    return _file_stamp(entry["path"])


def _names_regex(names):
    return "|".join(names) if names else "(?!)"


def get_generated_matrix_regex():
    """Wildcard regex of the matrices generate_matrix makes as .csr4 (presets with csr4: true)."""
    names = [
        name
        for name, entry in config["matrices"].items()
        if entry["preset"] and not is_generated_direct(name)
    ]
    return _names_regex(names)


def get_direct_matrix_regex():
    """Wildcard regex of the matrices generate_container writes directly."""
    return _names_regex(
        [name for name in config["matrices"] if is_generated_direct(name)]
    )


def get_converted_matrix_regex():
    """Wildcard regex of the matrices convert_matrix makes (every other one)."""
    return _names_regex(
        [name for name in config["matrices"] if not is_generated_direct(name)]
    )


def get_matrix_fold(wildcards):
    """Whether results/{matrix}/matrix.h5 stores each distinct row once (docs/formats.md, "Folded matrices")."""
    return bool(config["matrices"][wildcards.matrix]["fold"])


def get_matrix_clip_negative(wildcards):
    """Whether the conversion sets the matrix's negative values to 0 (mlem convert --clip-negative)."""
    return bool(config["matrices"][wildcards.matrix]["clip_negative"])


def get_voxel_order(wildcards):
    """Column order of a matrix the generator writes into its container: raster or hilbert."""
    return config["matrices"][wildcards.matrix]["voxel_order"]


def get_matrix_format(wildcards):
    """Matrix format of results/{matrix}/matrix.h5: csr or a compressed format (docs/formats.md)."""
    return config["matrices"][wildcards.matrix]["format"]


def get_exact_source(matrix):
    """The lossless file a matrix stored in a lossy format (compressed-f16,
    compressed-u16) is converted from: the generated .csr4 or the user's file.
    None for a lossless format, a preset generated straight into its
    container, or a user's file that is itself a lossy container."""
    entry = config["matrices"][matrix]
    if entry["format"] not in LOSSY_FORMATS or is_generated_direct(matrix):
        return None
    if entry["path"] is None:
        return get_path("csr4", matrix=matrix)
    if file_kind(entry["path"]) == "h5":
        path = Path(entry["path"])
        if h5_is_lossy(str(path), path.stat().st_mtime_ns):
            return None
    return entry["path"]


@functools.lru_cache(maxsize=None)
def h5_is_lossy(path, mtime_ns):
    """Whether the HDF5 matrix at path is a lossy compressed container (read
    once per file version, not at every evaluation of the DAG)."""
    import h5py

    from mlemlib.formats.compressed_h5 import FORMATS

    with h5py.File(path, "r") as f:
        return FORMATS.get(f.attrs.get("format")) in LOSSY_FORMATS


# ------------------------------------------------------------------ reorder


def is_reordered():
    """True when reorder_matrix makes results/{matrix}/matrix.h5 (reorder: rows
    or rows+voxels, or OSEM subsets, whose rows it groups)."""
    return config["reorder"] != "none" or is_subsetted()


def get_reorder_mode(wildcards):
    """The permutation reorder_matrix computes: none (subsets only), rows or rows+voxels."""
    return config["reorder"]


def get_subsets(wildcards=None):
    """OSEM subsets S of the reorder stage (its rows grouped) and of every run."""
    return config["mlem"]["subsets"]


def get_subset_input(wildcards=None):
    """Named input subset_file (the user's subsets, mlem.subset_file) where configured."""
    path = config["mlem"]["subset_file"]
    return {"subset_file": path} if path else {}


def get_converted_matrix():
    """Path pattern of the user's matrix as convert_matrix writes it (and
    simulate_measurement reads it): matrix.h5, or converted.h5 when
    reorder_matrix makes matrix.h5 from it."""
    return PATHS["converted"] if is_reordered() else PATHS["matrix"]


# ---------------------------------------------------------------- transpose


def get_transpose_method(wildcards=None):
    """The method that writes results/{matrix}/transpose.h5."""
    return config["transpose"]["method"]


def get_transpose_gpus(wildcards):
    """GPUs a transposition occupies: 1 for cusparse, else 0."""
    method = getattr(wildcards, "method", None) or get_transpose_method()
    return 1 if method == "cusparse" else 0


def get_compared_transpose_methods():
    """Further transposition methods timed for the comparison table."""
    default = get_transpose_method()
    return [
        method
        for method in config["transpose"]["compare"]
        if method != default and (method != "cusparse" or is_gpu_enabled())
    ]


def run_reads_transpose(run, matrix):
    """True when a run reads transpose.h5 itself (mlemlib.compose.reads_transpose):
    a cpu run whose back projection reads A^T, a thesis-layout run (its row
    blocks of A^T), and a one-GPU run of such a kernel on a compressed matrix
    (but one that reads the partition's part files: needs_part_files). A GPU
    transposes a CSR matrix (or its block of rows, in the local layout) itself
    with cuSPARSE, faster than reading A^T from disk, and a compressed block's
    A_k^T comes from the partition's part files."""
    return compose.reads_transpose(get_combination(run, matrix))


def is_transpose_needed(matrix):
    """True when some job reads results/{matrix}/transpose.h5: a run that
    reads it (run_reads_transpose), a partition that needs it
    (is_partition_transposed) or the transposition comparison. Runs without
    a transpose (notrans, the one-pass iteration), GPU runs on a CSR matrix
    and the SpMV benchmark (it transposes on its GPU where no transpose.h5 is
    made) never make one."""
    return (
        any(run_reads_transpose(run, matrix) for run in get_runs())
        or any(is_partition_transposed(parts, matrix) for parts in get_part_counts())
        or bool(get_compared_transpose_methods())
    )


# --------------------------------------------------------------- partitions


def needs_part_files(run, matrix):
    """True when a run back-projects on each GPU's A_k^T read from the
    partition's part files (partition_matrix writes them: is_local_transpose):
    mlemlib.compose.needs_part_files of the run's combination, one rule for
    the workflow and the combination test. A cuda run of the local layout
    whose bp reads A^T, on a compressed matrix, without OSEM subsets (a
    subset file counts: is_subsetted); on one GPU only where ``graph: true``
    takes the several-GPU backend and bp names the kernel.
    """
    if is_subsetted():
        return False
    return compose.needs_part_files(get_combination(run, matrix))


def run_reads_plan(run, matrix):
    """True when a run reads results/{matrix}/parts-{gpus}/plan.json: every run
    on several GPUs, and one on one GPU that needs the part files."""
    return run["gpus"] > 1 or needs_part_files(run, matrix)


def get_part_counts():
    """Part counts to plan: the partition table's plus every run's that reads a plan."""
    counts = set(config["partition"]["parts"])
    counts.update(
        run["gpus"]
        for run in get_runs()
        for matrix in get_matrices()
        if run_reads_plan(run, matrix)
    )
    return sorted(counts)


def get_parts(wildcards):
    """Part count of partition_matrix (the {parts} wildcard as an integer)."""
    return int(wildcards.parts)


def _runs_of(parts):
    return [run for run in get_runs() if run["gpus"] == parts]


def is_local_transpose(parts, matrix):
    """True when partition_matrix writes part-{k}.h5 (A_k^T) for `parts` GPUs
    (else the plan only references A): a run on `parts` GPUs needs them
    (needs_part_files)."""
    return any(needs_part_files(run, matrix) for run in _runs_of(parts))


def is_partition_transposed(parts, matrix):
    """True when the plan of `parts` needs transpose.h5: for part-{k}.h5, or
    for the row blocks of A^T of a thesis-layout run."""
    return is_local_transpose(parts, matrix) or any(
        run["layout"] == "thesis" for run in _runs_of(parts)
    )


def get_partition_input(wildcards):
    """Named inputs of partition_matrix: the matrix, and transpose.h5 where needed."""
    inputs = {"matrix": get_path("matrix", matrix=wildcards.matrix)}
    if is_partition_transposed(int(wildcards.parts), wildcards.matrix):
        inputs["transpose"] = get_path("transpose", matrix=wildcards.matrix)
    return inputs


def get_local_transpose(wildcards):
    """Whether partition_matrix writes the parts' A_k^T (is_local_transpose)."""
    return is_local_transpose(int(wildcards.parts), wildcards.matrix)


# ------------------------------------------------------------------- chunks


def get_chunk_window():
    """Voxels per chunk of chunk_matrix: mlemlib.chunked.DEFAULT_WINDOW (what an
    H100's or H200's shared memory holds; a GPU with less refuses the file)."""
    from mlemlib.chunked import DEFAULT_WINDOW

    return DEFAULT_WINDOW


def get_chunk_cap():
    """Most non-zeros per chunk of chunk_matrix: mlemlib.chunked.MAX_CHUNK_NNZ
    (a params entry, so that a changed rule makes chunks.h5 again)."""
    from mlemlib.chunked import MAX_CHUNK_NNZ

    return MAX_CHUNK_NNZ


def is_chunked_run(run):
    """True when a run reads results/{matrix}/chunks.h5: a cuda run on one GPU
    or in the local layout whose bp reads row chunks (onepass_chunked), or
    whose bp and fp are auto on a matrix the reorder stage ordered (auto
    takes the chunked one pass where the chunks reuse voxels)."""
    if run["backend"] != "cuda" or (run["gpus"] > 1 and run["layout"] != "local"):
        return False
    if run["bp"] == "auto":
        return run["fp"] == "auto" and is_reordered()
    return get_bp("cuda", run["bp"]).chunks


def is_chunks_needed():
    """True when some run reads chunks.h5 (is_chunked_run)."""
    return any(is_chunked_run(run) for run in get_runs())
