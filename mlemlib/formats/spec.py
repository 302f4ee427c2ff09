"""What each system-matrix format is: one :class:`MatrixFormat` per format (host side; no CuPy).

The formats are the container's (``mlem convert --format``): ``csr`` and the
compressed ones, ``compressed`` (exact float32 values), ``compressed-f16`` and
``compressed-u16`` (lossy 16-bit values). Each :class:`MatrixFormat` gathers
what the library needs to know of its format, so that code outside
:mod:`mlemlib.formats` asks the description why it branches (encoded rows,
exact values, row scales, integer codes, what cuSPARSE reads, which kernels
``auto`` takes, its device type, its bytes) and never compares a format's
name. :func:`matrix_format_of` finds the description of a name or of
anything that holds a matrix.

Where each part of a format lives:

- reader and writer: CSR in :mod:`mlemlib.formats.h5` (``MatrixH5``,
  ``MatrixH5Writer``), the compressed formats in
  :mod:`mlemlib.formats.compressed_h5` (``CompressedH5``,
  ``CompressedH5Writer``); ``MatrixH5(path)`` opens either, and
  :meth:`MatrixFormat.writer` makes the format's writer. The encoding itself
  (code widths, value dtypes, row scales) is :mod:`mlemlib.compressed`'s, and
  the facts of the values here are read from its tables (``VALUE_DTYPES``,
  ``LOSSY_FORMATS``, ``values16``), so that they have one source.
- device upload: :attr:`MatrixFormat.device_type`, the ``module:class`` of its
  :class:`~mlemlib.backends.device_formats.DeviceMatrix`.
- kernels: the registry (:mod:`mlemlib.registry`) declares which formats each
  kernel reads; the description names the row kernel ``auto`` takes, the one
  without a transpose, and builds the one-pass kernels' names.
- bytes: :meth:`MatrixFormat.nbytes` (exact, of the arrays),
  :meth:`MatrixFormat.slot_bytes`, :attr:`MatrixFormat.row_bytes` and the
  planning figure :attr:`MatrixFormat.bytes_per_nnz` (:mod:`mlemlib.cluster`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlemlib.compressed import LOSSY_FORMATS, ROW_BLOCK, SLOT_ALIGN, VALUE_DTYPES, rowbase_length, values16
from mlemlib.errors import ConfigError

__all__ = [
    "ALL_FORMATS",
    "COMPRESSED",
    "COMPRESSED_F16",
    "COMPRESSED_U16",
    "CSR",
    "NAMES",
    "MatrixFormat",
    "matrix_format_of",
]


@dataclass(frozen=True)
class MatrixFormat:
    """One matrix format: the facts the library branches on.

    Attributes
    ----------
    name
        The format's name (``mlem convert --format``, a config's ``format:``, the kernels' ``formats``).
    compressed
        Its rows are encoded (column deltas in 8- or 16-bit codes, value slots, a two-level row
        pointer: :mod:`mlemlib.compressed`) and read by the compressed kernels; False: plain CSR
        arrays (int64 row pointer, int32 columns, float32 values).
    lossless
        Its values are the matrix's float32 values bit for bit (a lossy format rounds them to 16 bits).
    row_scales
        Its values are 16 bits times a float32 scale per row (a ``scale`` array beside the values).
    integer_codes
        Its values are unsigned 16-bit integers, a fixed point per row (``compressed-u16``): encoded as
        ``rint(v / scale)`` straight into 16 bits, decoded as ``float32(q) * scale``; the float16 values
        of ``compressed-f16`` keep relative precision instead.
    value_dtype
        The dtype of its stored values.
    cusparse
        cuSPARSE reads its arrays (plain CSR): a GPU transposes it itself (``csr2csc``) and the
        ``cusparse`` kernels take it; a compressed matrix's transpose is stored (``mlem transpose``,
        the partition's part files).
    slots_per_lane
        Stored elements a lane of its row kernels reads per trip: 1 (CSR), :data:`~mlemlib.compressed.SLOT_ALIGN`
        (compressed rows, aligned to 4 slots).
    row_kernel
        The cuda row kernel ``auto`` takes for the forward projection and, on a stored ``A^T``, the
        back projection (``csr_vector``, ``delta_vector``).
    notrans_kernel
        What ``bp=auto`` takes on cuda without a transpose: the ``notrans`` selector (CSR) or the
        fixed-point one pass ``onepass_fixed`` (compressed).
    device_type
        ``module:class`` of its device type (:func:`mlemlib.backends.device_formats.device_type`).
    row_bytes
        Bytes per row of its row pointer (and row scales): CSR's int64 pointer 8; the compressed
        formats' uint32 offset and one int64 base per 64 rows, 4.125, plus 4 for a row scale.
    bytes_per_nnz
        Bytes per non-zero of its element arrays, as planned before a matrix exists
        (:mod:`mlemlib.cluster`): CSR's 8; the compressed formats' slots (a code and a value) with the
        markers and pads measured on system matrices (docs/formats.md), rounded up.
    """

    name: str
    compressed: bool
    lossless: bool
    row_scales: bool
    integer_codes: bool
    value_dtype: np.dtype
    cusparse: bool
    slots_per_lane: int
    row_kernel: str
    notrans_kernel: str
    device_type: str
    row_bytes: float
    bytes_per_nnz: float

    @property
    def value_tag(self) -> str:
        """Its value type in kernel names: ``f32``, ``f16`` or ``u16``."""
        return f"{self.value_dtype.kind}{8 * self.value_dtype.itemsize}"

    def kernel_kind(self, code_bits: int = 8) -> str:
        """The part of its kernels' names that says what they read: ``csr``, or the values and the code
        width of a compressed matrix (``f32c8``, ``f16c16``, ``u16c8``: ``DeviceCompressed.kind``)."""
        return f"{self.value_tag}c{int(code_bits)}" if self.compressed else self.name

    def onepass_kernel(self, kind: str, lanes: int, det: bool) -> str:
        """The one-pass kernel (``mlemlib/kernels/compressed.cu``) of a device matrix of this format whose
        kernels are of ``kind`` (:meth:`kernel_kind`): ``onepass_[det_]csr_<lanes>`` (one element per lane),
        ``conepass_[det_]<kind>_<lanes>`` (4 slots per lane); ``det``: the 64-bit fixed-point one."""
        return f"{'conepass' if self.compressed else 'onepass'}_{'det_' if det else ''}{kind}_{lanes}"

    def slot_bytes(self, code_bits: int = 8) -> int:
        """Bytes of one stored element: CSR's int32 column and float32 value (8); a compressed slot's code
        (``code_bits`` / 8) and value."""
        if not self.compressed:
            return 8
        return int(code_bits) // 8 + self.value_dtype.itemsize

    def nbytes(self, rows: int, slots: int, code_bits: int = 8) -> int:
        """Bytes of the arrays of a matrix of ``rows`` rows and ``slots`` stored elements (a compressed
        matrix's slots: its non-zeros, markers and pads) with ``code_bits`` codes: CSR's ``8 * nnz + 8 *
        (rows + 1)``; the compressed formats' ``rowbase``, ``rowoff``, codes, values and row scales."""
        rows, slots = int(rows), int(slots)
        if not self.compressed:
            return 8 * slots + 8 * (rows + 1)
        scales = 4 * rows if self.row_scales else 0
        return 8 * rowbase_length(rows) + 4 * (rows + 1) + slots * self.slot_bytes(code_bits) + scales

    def writer(self, path: str | os.PathLike, shape: tuple[int, int], nnz: int | None, *,
               code_bits: int | None = None, **attrs: Any):
        """The container writer of this format for ``path`` (``MatrixH5Writer``, or ``CompressedH5Writer``
        with ``code_bits``, None: chosen by the writer); ``attrs`` as the writers take them (``source``,
        ``grid``, ...).

        Raises
        ------
        ValueError
            ``code_bits`` given for CSR, which has no codes.
        """
        if not self.compressed:
            if code_bits is not None:
                raise ValueError(f"the {self.name} format has no codes (code_bits {code_bits!r})")
            from mlemlib.formats.h5 import MatrixH5Writer

            return MatrixH5Writer(path, shape, nnz, **attrs)
        from mlemlib.formats.compressed_h5 import CompressedH5Writer

        return CompressedH5Writer(path, shape, nnz, fmt=self.name, code_bits=code_bits, **attrs)


def _compressed(name: str, bytes_per_nnz: float) -> MatrixFormat:
    """A compressed format: its values' facts from :mod:`mlemlib.compressed`'s tables."""
    dtype = VALUE_DTYPES[name]
    scaled = values16(name)
    return MatrixFormat(
        name=name,
        compressed=True,
        lossless=name not in LOSSY_FORMATS,
        row_scales=scaled,
        integer_codes=dtype.kind == "u",
        value_dtype=dtype,
        cusparse=False,
        slots_per_lane=SLOT_ALIGN,
        row_kernel="delta_vector",
        notrans_kernel="onepass_fixed",
        device_type="mlemlib.backends._compressed_cuda:DeviceCompressed",
        row_bytes=4 + 8 / ROW_BLOCK + (4 if scaled else 0),
        bytes_per_nnz=bytes_per_nnz,
    )


CSR = MatrixFormat(
    name="csr",
    compressed=False,
    lossless=True,
    row_scales=False,
    integer_codes=False,
    value_dtype=np.dtype(np.float32),
    cusparse=True,
    slots_per_lane=1,
    row_kernel="csr_vector",
    notrans_kernel="notrans",
    device_type="mlemlib.backends._cuda_kernels:DeviceCSR",
    row_bytes=8.0,
    bytes_per_nnz=8.0,
)
COMPRESSED = _compressed("compressed", 5.05)
COMPRESSED_F16 = _compressed("compressed-f16", 3.05)
COMPRESSED_U16 = _compressed("compressed-u16", 3.05)
#: Every format, ``csr`` (the default) first.
ALL_FORMATS: tuple[MatrixFormat, ...] = (CSR, COMPRESSED, COMPRESSED_F16, COMPRESSED_U16)
#: Their names, in that order.
NAMES: tuple[str, ...] = tuple(f.name for f in ALL_FORMATS)
_BY_NAME = {f.name: f for f in ALL_FORMATS}


def matrix_format_of(x: Any) -> MatrixFormat:
    """The description of a format: ``x`` itself (a :class:`MatrixFormat`), the format named ``x`` (a str),
    or the format of anything that holds a matrix (its ``format``: a compressed reader or matrix, a device
    matrix, a chunked layout, a backend), ``csr`` for one without a format of :data:`NAMES` (a CSR reader, a
    :class:`~mlemlib.matrix.CSRMatrix`, SciPy's CSR).

    Raises
    ------
    ConfigError
        A name (str) that is no matrix format.
    """
    if isinstance(x, MatrixFormat):
        return x
    if isinstance(x, str):
        try:
            return _BY_NAME[x]
        except KeyError:
            raise ConfigError("format", f"unknown matrix format {x!r}, expected one of {', '.join(NAMES)}") from None
    fmt = getattr(x, "format", None)
    if isinstance(fmt, MatrixFormat):
        return fmt
    return _BY_NAME.get(fmt, CSR) if isinstance(fmt, str) else CSR
