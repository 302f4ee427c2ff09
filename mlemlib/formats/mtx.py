"""Reader of Matrix Market (``.mtx``, optionally ``.mtx.gz``) system matrices, via SciPy; NumPy.

The whole file is parsed by :func:`scipy.io.mmread` (Matrix Market is a text
format without random access) and converted to a validated
:class:`~mlemlib.matrix.CSRMatrix`: duplicates summed, float32 values.
"""

from __future__ import annotations

import os

from mlemlib.errors import MatrixFormatError
from mlemlib.formats._memory import csr_from_scipy
from mlemlib.matrix import CSRMatrix


def read_mtx(path: str | os.PathLike) -> CSRMatrix:
    """Read a Matrix Market file into a validated CSR matrix.

    Raises
    ------
    MatrixFormatError
        Missing or unparsable file, complex values, negative or non-finite values.
    """
    import scipy.io

    source = os.fspath(path)
    if not os.path.exists(path):
        raise MatrixFormatError(source, "no such file")
    try:
        a = scipy.io.mmread(source)
    except (ValueError, TypeError, IndexError, OSError, EOFError, UnicodeDecodeError) as exc:
        raise MatrixFormatError(source, f"not a valid Matrix Market file ({exc})") from None
    return csr_from_scipy(a, source)
