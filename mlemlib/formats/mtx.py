"""Reader of Matrix Market (``.mtx``, optionally ``.mtx.gz``) system matrices, via SciPy; NumPy.

The whole file is parsed by :func:`scipy.io.mmread` (Matrix Market is a text
format without random access) and converted to a validated
:class:`~mlemlib.matrix.CSRMatrix`: duplicates summed, float32 values.
"""

from __future__ import annotations

import os
import re

from mlemlib.errors import MatrixFormatError
from mlemlib.formats._memory import csr_from_scipy
from mlemlib.matrix import CSRMatrix


def read_mtx(path: str | os.PathLike, *, allow_negative: bool = False) -> CSRMatrix:
    """Read a Matrix Market file into a validated CSR matrix (negative values refused unless ``allow_negative``).

    Raises
    ------
    MatrixFormatError
        Missing or unparsable file, an index beyond the declared shape (with
        its line), complex values, negative or non-finite values.
    """
    import scipy.io

    source = os.fspath(path)
    if not os.path.exists(path):
        raise MatrixFormatError(source, "no such file")
    if os.path.isdir(path):
        raise MatrixFormatError(source, "is a directory, expected a Matrix Market file")
    try:
        a = scipy.io.mmread(source)
    except (ValueError, TypeError, IndexError, OSError, EOFError, UnicodeDecodeError) as exc:
        raise MatrixFormatError(source, _fault(source, exc)) from None
    return csr_from_scipy(a, source, allow_negative=allow_negative)


def _fault(source: str, exc: BaseException) -> str:
    """The reader's words for a file SciPy could not parse: an index out of range with the declared shape."""
    import scipy.io

    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    found = re.search(r"[Ll]ine (\d+): (Row|Column) index out of bounds", text)
    if found:
        try:
            m, n = (int(v) for v in scipy.io.mminfo(source)[:2])
            shape = f": the header declares a {m} x {n} matrix (rows 1..{m}, columns 1..{n})"
        except (ValueError, TypeError, IndexError, OSError, EOFError, UnicodeDecodeError):
            shape = ""
        return f"{found.group(2).lower()} index out of bounds on line {found.group(1)}{shape}"
    return f"not a valid Matrix Market file ({text})"
