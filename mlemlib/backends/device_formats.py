"""Matrix formats on the device: the one interface each format's device type implements (no CuPy at import).

A format (:class:`mlemlib.formats.spec.MatrixFormat`, whose ``device_type`` names its type here) is one
:class:`DeviceMatrix` subclass (how it is uploaded, how many
bytes it takes, its non-zeros, the rows it holds) plus one module of kernels
(``mlemlib/kernels/<format>.cu``) whose kernels the registry
(:mod:`mlemlib.registry`) declares with that format. The one-GPU and the
multi-GPU backends upload through :meth:`DeviceMatrix.upload` (the whole
matrix, or the row range a GPU owns), so both run the same kernels on the
same type.

Formats
-------
``csr``   :class:`mlemlib.backends._cuda_kernels.DeviceCSR`: int64 row
          pointer, int32 columns, float32 values (8 bytes per non-zero).
``compressed``, ``compressed-f16``, ``compressed-u16``
          :class:`mlemlib.backends._compressed_cuda.DeviceCompressed`: column
          deltas of 8 or 16 bits and float32 (16-bit) values, about 5-6 (3-4)
          bytes per non-zero; a CSR source is encoded on its way to the GPU.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from mlemlib.errors import ConfigError
from mlemlib.formats.spec import ALL_FORMATS, MatrixFormat

#: Format name -> ``module:class`` of its device type (imported when first used; each format's
#: :attr:`~mlemlib.formats.spec.MatrixFormat.device_type`).
DEVICE_TYPES = {f.name: f.device_type for f in ALL_FORMATS}


class DeviceMatrix(ABC):
    """A system matrix (or a row block of one) in GPU memory, in one format.

    Attributes
    ----------
    format
        The format's name, as the registry's kernels name it.
    shape
        ``(rows held, columns)``.
    """

    format: ClassVar[str]
    shape: tuple[int, int]

    @classmethod
    @abstractmethod
    def upload(
        cls, source: Any, rows: tuple[int, int] | None = None, *, device: int | None = None, align: bool = False,
        what: str = "matrix", fmt: str | None = None,
    ) -> DeviceMatrix:
        """Put ``source`` (rows ``[r0, r1)`` of it, or all) on ``device`` (default: the current one).

        ``source`` is an opened matrix (only the rows asked for are read,
        streamed in blocks), an in-memory host matrix, or a device matrix of
        the same type on any GPU. ``align`` keeps a row block's vector
        alignment as in the whole matrix, where the format's kernels need it
        to sum each row exactly as on one GPU. ``fmt`` names the format to
        encode a source of another format into (one type may hold several).
        """

    @classmethod
    def reads(cls, fmt: str) -> bool:
        """Whether a source of format ``fmt`` uploads into this type in its own encoding (a type may hold
        several formats: the compressed one holds all three)."""
        entry = DEVICE_TYPES.get(fmt)
        return entry is not None and entry.rpartition(":")[2] == cls.__name__

    @classmethod
    def transpose_format(cls, transpose: Any, a_format: str) -> str:
        """The format a stored ``A^T`` (or a part file of it) goes to the GPU in, beside ``A`` of ``a_format``:
        its own where this type reads it (a compressed ``A^T`` keeps its encoding: a lossy ``A``'s transpose is
        stored exact, and encoding it as ``A`` is would round its values again), else ``A``'s (a CSR one is
        encoded as ``A`` is)."""
        from mlemlib.formats.spec import matrix_format_of

        own = matrix_format_of(transpose).name
        return own if cls.reads(own) else a_format

    @staticmethod
    @abstractmethod
    def device_bytes(source: Any) -> int:
        """Bytes all of ``source`` will take on the device in this format (checked before upload)."""

    #: Stored non-zeros (without padding) and bytes on the device: attributes or properties of each type.
    nnz: int
    nbytes: int


def device_type(fmt: str | MatrixFormat) -> type[DeviceMatrix]:
    """The device type of format ``fmt`` (a name or a description; CuPy is imported by that module's methods,
    not here)."""
    fmt = fmt.name if isinstance(fmt, MatrixFormat) else fmt
    if fmt not in DEVICE_TYPES:
        raise ConfigError("format", f"no device type for matrix format {fmt!r}; known: {', '.join(DEVICE_TYPES)}")
    mod, _, cls = DEVICE_TYPES[fmt].partition(":")
    return getattr(importlib.import_module(mod), cls)

