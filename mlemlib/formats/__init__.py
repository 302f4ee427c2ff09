"""Readers and writers of system-matrix and measurement files; host memory, NumPy/SciPy/h5py.

Supported files (see ``docs/formats.md``):

- ``.csr4``: the TUM MLEM tools' system matrix (memory-mapped, read by row range),
- ``.h5``: the project's own container (chunked HDF5, read by row range), holding
  CSR or the compressed matrix (``compressed``, ``compressed-f16``, ``compressed-u16``),
- ``.mtx`` / ``.mtx.gz``: Matrix Market; ``.npz``: SciPy sparse (read whole),
- ``.LMsino`` / ``.sino``: measurements (raw int32 counts).

:func:`open_matrix` returns a reader with one interface for every matrix format
(``shape``, ``nnz``, ``grid``, ``voxel_size``, ``read_rows``, ``iter_chunks``,
``read_indptr``); :func:`convert` streams any matrix into the container and
:func:`info` describes and validates any supported file; :func:`matrix_format_of` gives a matrix
format's description (:mod:`mlemlib.formats.spec`: what the rest of the library asks instead of comparing
format names). Every reader raises
:class:`~mlemlib.errors.MatrixFormatError` or
:class:`~mlemlib.errors.SinogramFormatError` naming the file and the fault.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np

from mlemlib.compressed import LOSSY_FORMATS
from mlemlib.errors import MatrixFormatError, SinogramFormatError
from mlemlib.formats._check import DEFAULT_CHUNK_NNZ
from mlemlib.formats._memory import InMemoryMatrix
from mlemlib.formats.csr4 import (
    Csr4File,
    Csr4Header,
    Csr4Writer,
    ScannerGeometry,
    read_csr4,
    write_csr4,
)
from mlemlib.formats.compressed_h5 import (
    CompressedH5,
    CompressedH5Writer,
    conversion_summary,
    read_compressed_h5,
    sample_code_bits,
    write_compressed_h5,
)
from mlemlib.formats.h5 import (
    CHECKSUM_METHOD,
    MatrixH5,
    MatrixH5Writer,
    checksum_for,
    read_matrix_h5,
    write_matrix_h5,
)
from mlemlib.formats.lmsino import read_lmsino, write_lmsino
from mlemlib.formats.mtx import read_mtx
from mlemlib.formats.npz import read_npz
from mlemlib.formats.spec import NAMES, MatrixFormat, matrix_format_of
from mlemlib.matrix import take_rows
from mlemlib.setup_times import timed

__all__ = [
    "MATRIX_FORMATS",
    "CompressedH5",
    "CompressedH5Writer",
    "Csr4File",
    "Csr4Header",
    "Csr4Writer",
    "InMemoryMatrix",
    "MatrixFormat",
    "MatrixH5",
    "MatrixH5Writer",
    "ScannerGeometry",
    "convert",
    "container_path",
    "convert_command",
    "file_kind",
    "geometry_value",
    "info",
    "matrix_format",
    "matrix_format_of",
    "matrix_geometry",
    "open_matrix",
    "open_source",
    "read_compressed_h5",
    "sample_code_bits",
    "read_csr4",
    "read_lmsino",
    "read_matrix",
    "read_matrix_h5",
    "read_mtx",
    "read_npz",
    "require_container",
    "write_compressed_h5",
    "write_csr4",
    "write_lmsino",
    "write_matrix_h5",
]

log = logging.getLogger(__name__)

#: Matrix formats of the container (``mlem convert --format``); ``csr`` is the default. Each one's
#: description: :func:`matrix_format_of` (:mod:`mlemlib.formats.spec`).
MATRIX_FORMATS = NAMES

#: suffix (lower case) -> kind
SUFFIXES = {
    ".csr4": "csr4",
    ".h5": "h5",
    ".hdf5": "h5",
    ".mtx": "mtx",
    ".mtx.gz": "mtx",
    ".npz": "npz",
    ".lmsino": "lmsino",
    ".sino": "lmsino",
}


def file_kind(path: str | os.PathLike) -> str:
    """Return the kind of a file from its suffix: csr4, h5, mtx, npz or lmsino.

    Raises
    ------
    MatrixFormatError
        For an unknown suffix.
    """
    name = Path(path).name.lower()
    for suffix, kind in sorted(SUFFIXES.items(), key=lambda kv: -len(kv[0])):
        if name.endswith(suffix):
            return kind
    raise MatrixFormatError(path, f"unknown file type (expected one of {', '.join(sorted(set(SUFFIXES)))})")


@timed("open")
def open_matrix(path: str | os.PathLike, *, allow_negative: bool = False) -> Csr4File | MatrixH5 | InMemoryMatrix:
    """Open a system matrix by suffix: ``.csr4`` and ``.h5`` lazily, ``.mtx``/``.npz`` whole.

    The result is a context manager with ``shape``, ``nnz``, ``grid``,
    ``voxel_size``, ``read_rows(start, stop)``, ``iter_chunks(max_nnz)``,
    ``read_indptr()`` and ``to_csr()``. A compressed ``.h5`` container opens
    as a :class:`CompressedH5` (a :class:`MatrixH5` that decodes into CSR).
    Its validated reads refuse negative values unless ``allow_negative``
    (:func:`convert` with ``clip_negative``).

    Raises
    ------
    MatrixFormatError
        Unknown suffix, a measurement file, or any fault of the file.
    """
    kind = file_kind(path)
    if kind in ("csr4", "h5"):
        reader = Csr4File(path) if kind == "csr4" else MatrixH5(path)
        reader.allow_negative = allow_negative
        return reader
    if kind == "mtx":
        return InMemoryMatrix(read_mtx(path, allow_negative=allow_negative), path)
    if kind == "npz":
        return InMemoryMatrix(read_npz(path, allow_negative=allow_negative), path)
    raise MatrixFormatError(path, f"a {kind} file holds measurements, not a system matrix")


def matrix_format(path: str | os.PathLike) -> str:
    """The matrix format a file holds: an ``.h5`` container's own (``csr`` or a compressed one), else ``csr``.

    Raises
    ------
    MatrixFormatError
        An unknown suffix, or an ``.h5`` file that is not a matrix container.
    """
    if file_kind(path) != "h5":
        return "csr"
    with MatrixH5(path) as f:
        return matrix_format_of(f).name


def convert_command(path: str | os.PathLike, options: str = "") -> str:
    """The ``mlem convert`` command line that makes an HDF5 container of a matrix file.

    Parameters
    ----------
    path
        The matrix file (``.csr4``, ``.mtx``, ``.mtx.gz``, ``.npz``).
    options
        Further options to show (e.g. ``"--grid NX NY NZ"``).

    Returns
    -------
    str
        ``mlem convert PATH [OPTIONS] --out STEM.h5``, the container beside the input.
    """
    import shlex

    name = os.fspath(path)
    return " ".join(p for p in ("mlem convert", shlex.quote(name), options, "--out", shlex.quote(container_path(path))) if p)


def container_path(path: str | os.PathLike) -> str:
    """The container :func:`convert_command` names for a matrix file: its suffix replaced by ``.h5``."""
    name = os.fspath(path)
    for suffix in sorted(SUFFIXES, key=len, reverse=True):
        if name.lower().endswith(suffix):
            return name[: -len(suffix)] + ".h5"
    return name + ".h5"


def require_container(path: str | os.PathLike, reader: str) -> None:
    """Refuse, before any work, a file that is not an HDF5 matrix container by its suffix.

    Stages that read a container's own records (its checksum, format,
    permutations, subsets) take only ``.h5``; the message of any other matrix
    names the command that makes the container.

    Parameters
    ----------
    path
        The input file.
    reader
        Who reads it, for the message (``"mlem reorder"``).

    Raises
    ------
    MatrixFormatError
        ``x.csr4: a .csr4 matrix; mlem reorder reads an HDF5 container: make
        one with 'mlem convert x.csr4 --out x.h5'`` (and likewise for ``.mtx``
        and ``.npz``), a measurement file, or an unknown suffix.
    """
    kind = file_kind(path)
    if kind == "h5":
        return
    if kind == "lmsino":
        raise MatrixFormatError(path, f"a measurement, not a system matrix; {reader} reads an HDF5 matrix container")
    suffix = ".mtx.gz" if os.fspath(path).lower().endswith(".mtx.gz") else f".{kind}"
    raise MatrixFormatError(
        path, f"a {suffix} matrix; {reader} reads an HDF5 container: make one with '{convert_command(path)}'"
    )


def read_matrix(path: str | os.PathLike):
    """Read a whole matrix of any supported format into memory (a :class:`CSRMatrix`)."""
    with open_matrix(path) as f:
        return f.to_csr()


def convert(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    max_nnz: int = DEFAULT_CHUNK_NNZ,
    fmt: str | None = None,
    code_bits: int | None = None,
    keep_rows: np.ndarray | None = None,
    attach: tuple[dict, dict] | None = None,
    grid: tuple[int, int, int] | None = None,
    voxel_size: tuple[float, float, float] | None = None,
    clip_negative: bool = False,
) -> dict:
    """Convert any supported matrix into the container ``out`` (``matrix.h5``), streaming.

    A compressed container converted to its own format (``fmt`` None or its
    format) is copied with its stored values and row scales bit for bit
    (:func:`~mlemlib.formats.compressed_h5.copy_compressed`): decoding and
    encoding again could round a lossy (16-bit) matrix a second time.

    ``.csr4`` and ``.h5`` inputs are read one row block of at most ``max_nnz``
    elements at a time, so peak memory is about one block (``8 * max_nnz``
    bytes plus the row pointer). Every block is validated as it passes, so a
    finished conversion has validated the whole input. The output is written
    atomically: on any error nothing is left under ``out``. The scanner block,
    grid and voxel size of a ``.csr4`` are kept as attributes. An ``.h5`` input
    is also checked against its own stored checksum.

    Parameters
    ----------
    src
        Input matrix (``.csr4``, ``.h5``, ``.mtx``, ``.npz``).
    out
        Output container.
    max_nnz
        Elements per block.
    fmt
        Matrix format of the output (None, the default: the input's own, see
        :func:`matrix_format`): ``csr``, ``compressed``
        (lossless, about 5 bytes per non-zero), ``compressed-f16`` or
        ``compressed-u16`` (lossy 16-bit values: float16, or a per-row 16-bit
        fixed point); the compressed ones encode each block as it passes
        and need columns sorted within rows.
    code_bits
        Compressed formats: the code width, 8 or 16; None chooses it before
        the conversion from a sample of rows spread over the input
        (:func:`sample_code_bits`: 16 row ranges, about 4 million elements
        in all), the width whose encoding of the sample is smaller.
    keep_rows
        Boolean mask over the input's rows: write only these (in order); the
        input is still read, validated and checked whole. ``None``: every row.
        (:func:`mlemlib.fold.fold_file` keeps each distinct row's first
        occurrence.)
    attach
        ``(datasets, attributes)`` stored in the output besides the matrix
        (a fold's row map).
    grid, voxel_size
        The image grid ``(nx, ny, nz)`` (product ``n``) and voxel size (mm) to record, for an input that has
        none (``mlem convert --grid``); one it records already must agree
        (:func:`mlemlib.prior.given_geometry`).
    clip_negative
        Set values below zero to zero (kept as explicit zeros: the row
        pointer, the columns and the non-zero count stay the input's) and log
        how many there were and the smallest. Without it a negative value is
        refused, naming this option. (A matrix exported from a projector may
        hold a few tiny negative values from rounding.)

    Returns
    -------
    dict
        ``source``, ``output``, ``shape``, ``nnz``, ``chunks``, ``seconds``,
        ``bytes`` (output size), ``input_bytes``, ``checksum``, ``grid``,
        ``voxel_size``, ``format``, ``lossless``, ``bytes_per_nnz`` (of the
        matrix arrays, not the file), ``code_bits`` (compressed formats, else None);
        with ``keep_rows``, ``shape`` and ``nnz`` are the written ones and ``input_shape`` the input's;
        with ``clip_negative``, ``clipped`` (how many values were set to 0) and ``clipped_min`` (the
        smallest of them, None if none).

    Raises
    ------
    MatrixFormatError
        Any fault of the input (nothing is written).
    """
    if max_nnz < 1:
        raise ValueError(f"max_nnz must be >= 1, got {max_nnz}")
    if fmt is not None and fmt not in MATRIX_FORMATS:
        raise ValueError(f"unknown matrix format {fmt!r}, expected one of {', '.join(MATRIX_FORMATS)}")
    if code_bits is not None and code_bits not in (8, 16):
        raise ValueError(f"code_bits must be 8 or 16, not {code_bits!r}")
    src, out = Path(src), Path(out)
    if src.resolve() == out.resolve():
        raise MatrixFormatError(out, "output would overwrite the input")
    own = matrix_format(src)
    fmt = own if fmt is None else fmt
    if fmt != "csr" and fmt == own:
        from mlemlib.formats.compressed_h5 import copy_compressed

        if grid is not None or voxel_size is not None:  # recorded through the attachment, checked first
            from mlemlib.grid import given_geometry

            with MatrixH5(src) as r:
                g, vs = given_geometry(src, r.shape[1], grid, voxel_size, r.grid, r.voxel_size)
            geo = {"grid": np.array(g, dtype=np.int64)} | ({} if vs is None else {"voxel_size": np.array(vs)})
            attach = ((attach or ({}, {}))[0], (attach or ({}, {}))[1] | geo)
            summary = copy_compressed(src, out, code_bits=code_bits, keep_rows=keep_rows, attach=attach,
                                      max_nnz=max_nnz)
            summary |= {"grid": list(g), "voxel_size": None if vs is None else list(vs)}
        else:
            summary = copy_compressed(src, out, code_bits=code_bits, keep_rows=keep_rows, attach=attach,
                                      max_nnz=max_nnz)
        if clip_negative:  # a compressed container was validated when written: it holds no negative value
            log.info("%s: no negative value to set to 0", src)
            summary |= {"clipped": 0, "clipped_min": None}
        return summary
    t0 = time.perf_counter()
    clipped, clipped_min = 0, None
    with open_matrix(src, allow_negative=clip_negative) as reader:
        m, n = reader.shape
        if grid is not None or voxel_size is not None:
            from mlemlib.grid import given_geometry

            grid, voxel_size = given_geometry(src, n, grid, voxel_size, reader.grid, reader.voxel_size)
        else:
            grid, voxel_size = reader.grid, reader.voxel_size
        m_out, nnz_out, first = m, int(reader.nnz), None
        if keep_rows is not None:
            first = np.asarray(keep_rows, dtype=bool).reshape(-1)
            if first.shape[0] != m:
                raise ValueError(f"keep_rows has {first.shape[0]} entries, the input has {m} rows")
            m_out = int(first.sum())
            nnz_out = int(np.diff(np.asarray(reader.read_indptr(), dtype=np.int64))[first].sum())
            log.info("%s: writing %d of %d rows, %d of %d non-zeros", src.name, m_out, m, nnz_out, int(reader.nnz))
        extra: dict = {"kind": "matrix"}
        scanner_block = None
        if isinstance(reader, Csr4File):
            scanner_block = reader.header.scanner_block
            extra["csr4_flags"] = np.int64(reader.header.flags)
        elif isinstance(reader, MatrixH5):
            scanner_block = reader.scanner_block
            skip = {"format", "version", "shape", "nnz", "checksum", "checksum_method", "source"}
            skip |= {"grid", "voxel_size", "scanner_block", "slots", "encoding", "code_bits"}
            extra.update({k: v for k, v in reader.attrs.items() if k not in skip})
        log.info("converting %s (%d x %d, nnz %d) -> %s (%s)", src, m, n, reader.nnz, out, fmt)
        chunks = 0
        done = 0
        last_log = t0
        if fmt == "csr":
            writer_cls, fmt_kw = MatrixH5Writer, {}
        else:
            if code_bits is None:  # one width for the whole file: chosen from rows spread over the input
                code_bits = sample_code_bits(reader, fmt)
                log.info("%s: %d-bit codes (the smaller encoding of a sample of rows)", out, code_bits)
            writer_cls, fmt_kw = CompressedH5Writer, {"fmt": fmt, "code_bits": code_bits}
        # the writer's checksum is the input's unless the output rounds the values
        # (and unless the input has the legacy checksum: the output gets today's)
        input_sum = checksum_for(reader.checksum_method) if isinstance(reader, MatrixH5) else None
        if (input_sum is not None and fmt not in LOSSY_FORMATS and first is None and input_sum.method == CHECKSUM_METHOD
                and not clip_negative):
            input_sum = None  # the writer computes the same checksum
        if input_sum is not None:
            input_sum.update("indptr", np.zeros(1, dtype=np.int64))
        with writer_cls(
            out,
            (m_out, n),
            nnz_out,
            source=src.name,
            grid=grid,
            voxel_size=voxel_size,
            scanner_block=scanner_block,
            **fmt_kw,
            **extra,
        ) as writer:
            for r0, r1, block in reader.iter_chunks(max_nnz):
                if input_sum is not None:  # of the values as read, before any clipping
                    input_sum.update_rows(block.indptr[1:] + done, block.indices, block.data)
                kept = block if first is None else take_rows(block, np.flatnonzero(first[r0:r1]))
                if clip_negative:
                    kept, k, low = _clip_negative(kept)
                    if k:
                        clipped += k
                        clipped_min = low if clipped_min is None else min(clipped_min, low)
                if fmt == "csr":
                    writer.write_rows(kept, validate=False)  # the reader validated it
                else:
                    writer.write_rows(kept, validate=False, source=src)
                chunks += 1
                done += block.nnz
                del block  # free it before the next block is read: one block in memory at a time
                now = time.perf_counter()
                if now - last_log > 10:
                    last_log = now
                    log.info("  %d/%d rows, %.1f%% of nnz, %.0f s", r1, m, 100 * done / max(reader.nnz, 1), now - t0)
            if attach is not None:
                writer.attach(*attach)
            if isinstance(reader, MatrixH5):
                got = input_sum.hexdigest() if input_sum is not None else writer.checksum
                if got != reader.checksum:
                    raise MatrixFormatError(
                        src,
                        f"checksum mismatch: attribute says {reader.checksum}, data gives {got} (file corrupted)",
                    )
    seconds = time.perf_counter() - t0
    summary = conversion_summary(src, out, shape=(m_out, n), nnz=nnz_out, chunks=chunks, seconds=seconds,
                                 checksum=writer.checksum, grid=grid, voxel_size=voxel_size, fmt=fmt,
                                 lossless=fmt not in LOSSY_FORMATS, nbytes=_matrix_nbytes(out, fmt, m_out, nnz_out),
                                 code_bits=code_bits if fmt != "csr" else None,
                                 input_shape=(m, n) if first is not None else None)
    if clip_negative:
        if clipped:
            log.info("%s: %d negative value(s) set to 0, the smallest %.9g (kept as explicit zeros)",
                     src, clipped, clipped_min)
        else:
            log.info("%s: no negative value to set to 0", src)
        summary |= {"clipped": clipped, "clipped_min": clipped_min}
    log.info("converted %s -> %s: nnz %d in %.1f s", src, out, summary["nnz"], seconds)
    return summary


def _clip_negative(block):
    """``(block with its values below zero set to 0, how many there were, the smallest)``.

    A block with none is returned as it is; otherwise its values are copied
    first (a reader's block may be a view of its buffers or of the input).
    """
    from mlemlib.matrix import CSRMatrix

    data = block.data
    if len(data) == 0 or data.min() >= 0:
        return block, 0, None
    negative = data < 0
    low = float(data[negative].min())
    data = np.where(negative, np.float32(0), data).astype(data.dtype, copy=False)
    return CSRMatrix(block.indptr, block.indices, data, block.shape), int(negative.sum()), low


def _matrix_nbytes(path: str | os.PathLike, fmt: str, m: int, nnz: int) -> int:
    """Bytes of the matrix arrays of a container (the CSR arrays, or the encoded ones)."""
    if fmt == "csr":
        return 8 * nnz + 8 * (m + 1)
    with CompressedH5(path) as f:
        return f.nbytes


def _matrix_facts(reader) -> dict:
    """``matrix_format``, ``lossless`` and ``bytes_per_nnz`` of an opened matrix of any kind."""
    m = reader.shape[0]
    nnz = int(reader.nnz)
    if isinstance(reader, CompressedH5):
        return {
            "matrix_format": reader.format,
            "lossless": reader.lossless,
            "slots": reader.slots,
            "code_bits": reader.code_bits,
            "matrix_bytes": reader.nbytes,
            "bytes_per_nnz": reader.nbytes / nnz if nnz else None,
        }
    nbytes = 8 * nnz + 8 * (m + 1)  # int32 column + float32 value per element, int64 row pointer
    return {
        "matrix_format": "csr",
        "lossless": True,
        "matrix_bytes": nbytes,
        "bytes_per_nnz": nbytes / nnz if nnz else None,
    }


def _row_stats(indptr: np.ndarray) -> dict:
    counts = np.diff(indptr)
    if counts.size == 0:
        return {"empty_rows": 0, "row_nnz_min": 0, "row_nnz_max": 0, "row_nnz_mean": 0.0}
    return {
        "empty_rows": int(np.count_nonzero(counts == 0)),
        "row_nnz_min": int(counts.min()),
        "row_nnz_max": int(counts.max()),
        "row_nnz_mean": float(counts.mean()),
    }


def info(
    path: str | os.PathLike,
    *,
    full: bool = True,
    expected_length: int | None = None,
    max_nnz: int = DEFAULT_CHUNK_NNZ,
) -> dict:
    """Describe and validate any supported file.

    Parameters
    ----------
    path
        A ``.csr4``, ``.h5``, ``.mtx``, ``.npz`` or ``.LMsino`` file.
    full
        Validate every element (streams through the whole file; for ``.h5``
        also verifies the checksum). With ``False`` only the header and the row
        pointer are checked (``.mtx``/``.npz`` are always read whole).
    expected_length
        For a measurement: the matrix's number of rows.
    max_nnz
        Elements per block while validating.

    Returns
    -------
    dict
        ``path``, ``kind``, ``bytes``, ``verdict`` (what was checked), and per
        kind: ``shape``, ``nnz``, ``density``, row statistics, ``grid``,
        ``voxel_size``, ``matrix_format`` (csr, compressed, compressed-f16),
        ``lossless``, ``matrix_bytes`` and ``bytes_per_nnz`` (of the matrix
        arrays: CSR's 8 bytes per element plus the int64 row pointer, or the
        encoded arrays; None without elements), ``slots`` (compressed),
        ``flags``/``scanner`` (csr4), ``attrs`` (h5);
        ``length``, ``total_counts``, ``max_count``, ``zero_counts``
        (measurements).

    Raises
    ------
    MatrixFormatError, SinogramFormatError
        The first fault found.
    """
    kind = file_kind(path)
    source = os.fspath(path)
    if not os.path.exists(path):
        err = SinogramFormatError if kind == "lmsino" else MatrixFormatError
        raise err(source, "no such file")
    res: dict = {"path": source, "kind": kind, "bytes": os.path.getsize(path)}
    if kind == "lmsino":
        g = read_lmsino(path, expected_length)
        res.update(
            length=int(g.size),
            total_counts=int(g.sum(dtype=np.int64)),
            max_count=int(g.max()) if g.size else 0,
            zero_counts=int(np.count_nonzero(g == 0)),
            verdict="valid: size, length"
            + (" (matches the matrix)" if expected_length is not None else "")
            + ", counts non-negative",
        )
        return res
    with open_matrix(path) as reader:
        m, n = reader.shape
        res.update(shape=[m, n], nnz=int(reader.nnz), density=(reader.nnz / (m * n)) if m * n else 0.0)
        res["grid"] = list(reader.grid) if reader.grid else None
        res["voxel_size"] = list(reader.voxel_size) if reader.voxel_size else None
        if isinstance(reader, Csr4File):
            h = reader.header
            geo = h.geometry
            res.update(
                format="PCSR version 4",
                flags=h.flags,
                scanner_block_bytes=len(h.scanner_block),
                scanner={
                    "layers": [list(x) for x in geo.layers],
                    "n_blocks": geo.n_blocks,
                    "block_size": geo.block_size,
                    "n_rings": geo.n_rings,
                },
            )
        elif isinstance(reader, CompressedH5):
            res["format"] = (
                f"mlem-{reader.format} container version {reader.attrs['version']} "
                f"({'lossless' if reader.lossless else 'lossy'}, {reader.code_bits}-bit codes)"
            )
            res["attrs"] = {k: (f"<{len(v)} bytes>" if isinstance(v, bytes) else v) for k, v in reader.attrs.items()}
        elif isinstance(reader, MatrixH5):
            res["format"] = "mlem-csr container version 1"
            res["attrs"] = {k: (f"<{len(v)} bytes>" if isinstance(v, bytes) else v) for k, v in reader.attrs.items()}
        res.update(_matrix_facts(reader))
        indptr = reader.read_indptr()
        res.update(_row_stats(indptr))
        checked = {"csr4": ["header", "file size"], "h5": ["attributes", "dataset sizes"]}.get(kind, ["parsed"])
        checked.append("row pointer")
        if full or kind in ("mtx", "npz"):
            for r0, r1 in reader.chunk_bounds(max_nnz):
                reader.read_rows(r0, r1, validate=True)  # validated, then dropped at once
            checked += ["column indices", "values finite and >= 0"]
            if isinstance(reader, MatrixH5):
                reader.verify_checksum()
                checked.append("checksum")
        res["verdict"] = "valid: " + ", ".join(checked) + ("" if full or kind in ("mtx", "npz") else " (quick)")
    return res


def geometry_value(src, name: str):
    """``grid`` or ``voxel_size`` of an opened matrix: its own attribute, else its header's geometry (a
    ``.csr4``), else its container attribute; None where none has it."""
    value = getattr(src, name, None)
    if value is None:
        value = getattr(getattr(getattr(src, "header", None), "geometry", None), name, None)
    if value is None:
        value = (getattr(src, "attrs", None) or {}).get(name)
    return value


def matrix_geometry(src) -> tuple[tuple[int, int, int] | None, tuple[float, float, float] | None]:
    """``(grid, voxel_size)`` of an opened matrix (:func:`geometry_value`); Nones unless it has both."""
    grid, vs = geometry_value(src, "grid"), geometry_value(src, "voxel_size")
    if grid is None or vs is None:
        return None, None
    return tuple(int(v) for v in grid), tuple(float(v) for v in vs)  # type: ignore[return-value]


def open_source(matrix, what: str = "matrix"):
    """Any matrix the library is given, opened with the readers' interface.

    Parameters
    ----------
    matrix
        A path (through :func:`open_matrix`), a :class:`~mlemlib.matrix.CSRMatrix`
        or SciPy sparse matrix (wrapped in :class:`InMemoryMatrix`, no copy of
        a CSRMatrix), or an opened reader (returned as is).
    what
        Its role, for messages (``matrix``, ``transpose``).

    Raises
    ------
    ConfigError
        Anything else.
    """
    from mlemlib.errors import ConfigError
    from mlemlib.matrix import CSRMatrix

    if isinstance(matrix, (str, os.PathLike)):
        return open_matrix(matrix)
    if isinstance(matrix, CSRMatrix):
        return InMemoryMatrix(matrix, f"<{what} in memory>")
    if hasattr(matrix, "tocsr"):
        return InMemoryMatrix(CSRMatrix.from_scipy(matrix), f"<{what} in memory>")
    if hasattr(matrix, "shape") and hasattr(matrix, "read_rows"):
        return matrix
    raise ConfigError(what, f"expected a path, a CSRMatrix or an opened matrix, got {type(matrix).__name__}")
