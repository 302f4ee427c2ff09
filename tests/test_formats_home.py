"""One home per matrix format (mlemlib.formats.spec): each format's facts against independent expectations,
its bytes against containers its writers wrote, its kernels against the registry, and no format name
compared as a string outside mlemlib/formats/."""

from __future__ import annotations

import re
from pathlib import Path

import h5py
import numpy as np
import pytest

from mlemlib import registry
from mlemlib.errors import ConfigError
from mlemlib.formats import MATRIX_FORMATS, info, matrix_format, write_compressed_h5, write_matrix_h5
from mlemlib.formats.spec import ALL_FORMATS, COMPRESSED, CSR, NAMES, MatrixFormat, matrix_format_of
from mlemlib.matrix import CSRMatrix

REPO = Path(__file__).resolve().parents[1]

#: name -> compressed, lossless, row scales, integer codes, value dtype, cuSPARSE reads it,
#: bytes of a stored element with 8-bit and with 16-bit codes, row kernel, kernel without a transpose
EXPECTED = {
    "csr": (False, True, False, False, "float32", True, 8, 8, "csr_vector", "notrans"),
    "compressed": (True, True, False, False, "float32", False, 5, 6, "delta_vector", "onepass_fixed"),
    "compressed-f16": (True, False, True, False, "float16", False, 3, 4, "delta_vector", "onepass_fixed"),
    "compressed-u16": (True, False, True, True, "uint16", False, 3, 4, "delta_vector", "onepass_fixed"),
}


# --------------------------------------------------------------------------- the facts
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_format_states_its_facts(name):
    f = matrix_format_of(name)
    compressed, lossless, scales, integer, dtype, cusparse, b8, b16, row, notrans = EXPECTED[name]
    assert f.name == name
    assert (f.compressed, f.lossless, f.row_scales, f.integer_codes) == (compressed, lossless, scales, integer)
    assert f.value_dtype == np.dtype(dtype)
    assert f.cusparse is cusparse
    assert (f.slot_bytes(8), f.slot_bytes(16)) == (b8, b16)
    assert (f.row_kernel, f.notrans_kernel) == (row, notrans)
    assert f.slots_per_lane == (4 if compressed else 1)


def test_every_format_once_in_every_list_of_names():
    assert NAMES == tuple(EXPECTED) == tuple(f.name for f in ALL_FORMATS)
    assert MATRIX_FORMATS == registry.FORMATS == NAMES
    assert ALL_FORMATS[0] is CSR  # the default first


def test_matrix_format_of_a_name_a_description_or_a_source():
    assert matrix_format_of("compressed") is COMPRESSED
    assert matrix_format_of(COMPRESSED) is COMPRESSED

    class Source:
        format = "compressed-u16"

    assert matrix_format_of(Source()).integer_codes
    a = CSRMatrix(np.array([0, 1], np.int64), np.array([0], np.int32), np.array([1.0], np.float32), (1, 1))
    assert matrix_format_of(a) is CSR  # no format: CSR
    import scipy.sparse as sp

    assert matrix_format_of(sp.csc_matrix((2, 2))) is CSR  # SciPy's own format names are not ours
    with pytest.raises(ConfigError, match=r"^format: unknown matrix format 'csr5', expected one of csr, compressed"):
        matrix_format_of("csr5")


def test_the_compressed_formats_read_their_values_facts_from_the_codec():
    from mlemlib.compressed import LOSSY_FORMATS, VALUE_DTYPES, exact_format, values16

    for f in ALL_FORMATS:
        if not f.compressed:
            continue
        assert f.value_dtype == VALUE_DTYPES[f.name]
        assert f.lossless == (f.name not in LOSSY_FORMATS)
        assert f.row_scales == values16(f.name)
        assert matrix_format_of(exact_format(f.name)).lossless


# --------------------------------------------------------------------------- bytes, from the writers
def _banded(m: int, per_row: int, n: int) -> CSRMatrix:
    """Rows of ``per_row`` elements (a multiple of 4) from a column below 50, in steps of 3: no marker, no
    pad with either code width."""
    cols = np.arange(m)[:, None] % 50 + 3 * np.arange(per_row)[None, :]
    indptr = np.arange(0, m * per_row + 1, per_row, dtype=np.int64)
    values = np.linspace(0.5, 2.0, m * per_row, dtype=np.float32)
    return CSRMatrix(indptr, cols.reshape(-1).astype(np.int32), values, (m, n))


def _arrays_bytes(path: Path) -> int:
    """Bytes of a container's matrix arrays, read from its datasets."""
    with h5py.File(path, "r") as h:
        return sum(h[k].size * h[k].dtype.itemsize for k in ("indptr", "indices", "data", "rowbase", "rowoff",
                                                             "codes", "values", "scale") if k in h)


@pytest.mark.parametrize("code_bits", [8, 16])
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bytes_per_nonzero_of_a_written_matrix_are_the_descriptions(tmp_path, name, code_bits):
    m, per_row = 130, 8  # 130 rows: three row blocks of the compressed row pointer
    a = _banded(m, per_row, 400)
    path = tmp_path / f"{name}.h5"
    f = matrix_format_of(name)
    if f.compressed:
        write_compressed_h5(path, a, fmt=name, code_bits=code_bits)
    else:
        write_matrix_h5(path, a)
    got = _arrays_bytes(path)
    nnz = m * per_row
    assert matrix_format(path) == name
    assert got == f.nbytes(m, nnz, code_bits)  # no marker, no pad: one slot per non-zero
    facts = info(path)
    assert facts["matrix_bytes"] == got
    assert facts["bytes_per_nnz"] == pytest.approx(f.nbytes(m, nnz, code_bits) / nnz)
    # per element and per row: the element arrays, then the row pointer (and row scales)
    per_element = EXPECTED[name][6 if code_bits == 8 else 7]
    assert f.nbytes(m, 2 * nnz, code_bits) - f.nbytes(m, nnz, code_bits) == nnz * per_element
    assert f.nbytes(m, 0) == pytest.approx(f.row_bytes * m, abs=16)
    assert f.bytes_per_nnz >= f.slot_bytes(8)  # planned with markers and pads: at least a slot each


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_formats_writer_writes_a_container_of_it(tmp_path, name):
    f = matrix_format_of(name)
    a = _banded(6, 4, 64)
    path = tmp_path / "w.h5"
    with f.writer(path, a.shape, a.nnz, source="test") as w:
        w.write_rows(a)
    assert matrix_format(path) == name
    with pytest.raises(ValueError, match="has no codes"):
        CSR.writer(tmp_path / "x.h5", a.shape, a.nnz, code_bits=8)


# --------------------------------------------------------------------------- kernels and device types
@pytest.mark.parametrize("f", ALL_FORMATS, ids=NAMES)
def test_the_kernels_it_names_read_it(f):
    assert f.name in registry.get("cuda", "forward", f.row_kernel).formats
    assert f.name in registry.get("cuda", "back", f.row_kernel).formats
    assert f.name in registry.get_bp("cuda", f.notrans_kernel).formats
    assert f.cusparse == (f.name in registry.get("cuda", "forward", "cusparse").formats)
    assert registry.resolve("cuda", "auto", "auto", fmt=f.name).fp == f.row_kernel
    assert registry.resolve("cuda", "auto", "auto", fmt=f.name, transpose_available=False).bp == f.notrans_kernel
    # the CPU's auto takes scipy where scipy reads the format
    assert registry.resolve("cpu", "auto", "auto", fmt=f.name).fp == ("scipy" if f.cusparse else "numba")


@pytest.mark.parametrize("f", ALL_FORMATS, ids=NAMES)
def test_its_device_type(f):
    from mlemlib.backends.device_formats import DEVICE_TYPES, device_type

    assert DEVICE_TYPES[f.name] == f.device_type
    cls = device_type(f)  # imported without CuPy
    assert cls is device_type(f.name) and cls.reads(f.name)
    assert cls.__name__ == ("DeviceCompressed" if f.compressed else "DeviceCSR")


@pytest.mark.parametrize("a_format", NAMES)
@pytest.mark.parametrize("t_format", NAMES)
def test_a_stored_transpose_goes_to_the_gpu_in_its_own_encoding_where_the_type_reads_it(a_format, t_format):
    """The one rule of the 1-GPU backend, the part files of several GPUs and the thesis layout: a compressed
    A^T (a lossy A's transpose is stored exact, as ``compressed``) is uploaded as it is stored, never encoded as
    A is (which would round its values again); a CSR A^T beside a compressed A is encoded as A."""
    from mlemlib.backends.device_formats import device_type

    a, t = matrix_format_of(a_format), matrix_format_of(t_format)
    got = device_type(a).transpose_format(t, a_format)
    assert got == (t_format if a.compressed == t.compressed else a_format)


def test_kernel_names_built_from_the_format_are_the_device_matrixs():
    """The one-pass kernels' names as the launchers built them before they asked the format; the kind as
    DeviceCompressed gives it."""
    from mlemlib.backends._compressed_cuda import DeviceCompressed, _matrix_args, choose_lanes, onepass_lanes
    from mlemlib.compressed import CODE_DTYPES

    def old_name(kind, lanes, det):
        det_ = "det_" if det else ""
        return f"onepass_{det_}csr_{lanes}" if kind == "csr" else f"conepass_{det_}{kind}_{lanes}"

    for f in ALL_FORMATS:
        for bits in (8, 16):
            kind = f.kernel_kind(bits)
            if f.compressed:
                d = DeviceCompressed(np.zeros(2, np.int64), np.zeros(2, np.uint32), np.zeros(4, CODE_DTYPES[bits]),
                                     np.zeros(4, f.value_dtype), None, (1, 4), 1, bits)
                assert d.kind == kind
                got = _matrix_args(d)
                assert (got[0], got[1]) == (f, kind)
            else:
                assert kind == "csr"
            for lanes in (4, 8, 16, 32):
                for det in (False, True):
                    assert f.onepass_kernel(kind, lanes, det) == old_name(kind, lanes, det)
        for m, nnz in ((0, 0), (10, 75), (1000, 123_456), (3, 10**9)):
            old = (nnz / m if m else 0.0) / (4 if f.compressed else 1)  # the formula before
            assert onepass_lanes(m, nnz, f.name) == choose_lanes(old)

    class Arrays:  # device CSR arrays
        indptr = np.zeros(2, np.int64)
        indices = data = np.zeros(0)
        shape = (1, 1)

    fmt, kind, _, _ = _matrix_args(Arrays())
    assert fmt is CSR and kind == "csr"


# --------------------------------------------------------------------------- no name compared outside the home
_NAME = r"""["'](?:csr|compressed|compressed-f16|compressed-u16)["']"""
#: A format name compared (==, !=, in, not in, either side; a tuple, list or set of names; a set
#: difference; startswith).
COMPARED = re.compile(
    rf"(?:==|!=|\bin)\s*[(\[{{]?\s*{_NAME}"
    rf"|{_NAME}\s*(?:==|!=|\bnot\s+in\b|\bin\b)"
    rf"|[-&|^]\s*\{{\s*{_NAME}"
    rf"|startswith\(\s*{_NAME}"
)


def _sources() -> list[Path]:
    files = [p for top in ("mlemlib", "scripts", "tools", "perf") for p in (REPO / top).rglob("*.py")]
    return files + sorted((REPO / "rules").glob("*.smk")) + [REPO / "Snakefile"]


def _comparisons(path: Path) -> list[str]:
    return [f"{path.relative_to(REPO)}:{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1)
            if COMPARED.search(line)]


def test_the_scan_finds_a_comparison_in_every_form():
    hits = ['if fmt != "csr":', "x = a if kind == 'csr' else b", 'for fmt in ("compressed", "compressed-u16"):',
            'if "csr" in formats:', 'if fmt not in ["compressed-f16"]:', 'set(formats) - {"csr"}', 'fmt in {"csr"}',
            'if "compressed-u16" == fmt:', 'fmt.startswith("compressed")']
    misses = ['fmt = "csr"', '{"csr": 1}', 'fmt: str = "csr"', 'f(fmt="compressed")', '"csr4" == kind',
              'kind in ("csr4", "h5")', '"compressed.cu"']
    assert [h for h in hits if not COMPARED.search(h)] == []
    assert [h for h in misses if COMPARED.search(h)] == []


def test_no_format_name_is_compared_as_a_string_outside_mlemlib_formats():
    """Code outside mlemlib/formats/ asks a format's description (matrix_format_of) why it branches."""
    files = _sources()
    home = REPO / "mlemlib" / "formats"
    inside = [h for p in files if home in p.parents for h in _comparisons(p)]
    outside = [h for p in files if home not in p.parents for h in _comparisons(p)]
    assert len(files) > 100  # the scan reads the project
    assert inside, "the scan finds no comparison in mlemlib/formats/ either: it would pass on anything"
    assert outside == []


def test_the_description_is_frozen():
    with pytest.raises(AttributeError):
        CSR.compressed = True  # type: ignore[misc]
    assert isinstance(COMPRESSED, MatrixFormat)
