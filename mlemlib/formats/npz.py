"""Reader of SciPy sparse ``.npz`` files (``scipy.sparse.save_npz``); NumPy.

Any sparse format SciPy saves (CSR, CSC, COO, ...) is accepted and converted to
a validated :class:`~mlemlib.matrix.CSRMatrix` with float32 values. A file
that is not a zip archive (a ``.npy`` array, a text file), an archive of
arrays without SciPy's ``format`` entry (``numpy.savez`` of a dense matrix)
and a sparse archive SciPy cannot rebuild (an index beyond the shape, a
missing array) are each refused in one line naming the file.
"""

from __future__ import annotations

import os
import zipfile

import numpy as np

from mlemlib.errors import MatrixFormatError
from mlemlib.formats._memory import csr_from_scipy
from mlemlib.matrix import CSRMatrix

#: What to do with a file that holds no sparse matrix.
SAVE_HINT = "save the matrix with scipy.sparse.save_npz"


def _exc_words(exc: BaseException) -> str:
    """An exception's message without the quotes a KeyError adds."""
    return str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)


def read_npz(path: str | os.PathLike, *, allow_negative: bool = False) -> CSRMatrix:
    """Read a SciPy sparse ``.npz`` file into a validated CSR matrix (negative values refused unless ``allow_negative``).

    Raises
    ------
    MatrixFormatError
        Missing file, not a zip archive, an archive without a sparse matrix,
        or invalid content.
    """
    import scipy.sparse as sp

    source = os.fspath(path)
    if not os.path.exists(path):
        raise MatrixFormatError(source, "no such file")
    if os.path.isdir(path):
        raise MatrixFormatError(source, "is a directory, expected a SciPy sparse .npz file")
    if not zipfile.is_zipfile(source):
        with open(source, "rb") as fh:
            magic = fh.read(6)
        what = "a NumPy .npy array" if magic == b"\x93NUMPY" else "not a zip archive"
        raise MatrixFormatError(source, f"not a SciPy sparse .npz file: {what}; {SAVE_HINT}")
    try:
        with np.load(source, allow_pickle=False) as z:
            names = list(z.files)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise MatrixFormatError(source, f"not a SciPy sparse .npz file: unreadable archive ({exc})") from None
    if "format" not in names:
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        raise MatrixFormatError(
            source, f"not a SciPy sparse .npz file: the archive holds the arrays [{shown}] and no 'format' entry "
            f"(a dense array saved with numpy.savez?); {SAVE_HINT}"
        )
    try:
        a = sp.load_npz(source)
    except (ValueError, KeyError, TypeError, IndexError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise MatrixFormatError(source, f"invalid SciPy sparse matrix ({_exc_words(exc)})") from None
    return csr_from_scipy(a, source, allow_negative=allow_negative)
