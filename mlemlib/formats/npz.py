"""Reader of SciPy sparse ``.npz`` files (``scipy.sparse.save_npz``); NumPy.

Any sparse format SciPy saves (CSR, CSC, COO, ...) is accepted and converted to
a validated :class:`~mlemlib.matrix.CSRMatrix` with float32 values.
"""

from __future__ import annotations

import os
import zipfile

from mlemlib.errors import MatrixFormatError
from mlemlib.formats._memory import csr_from_scipy
from mlemlib.matrix import CSRMatrix


def read_npz(path: str | os.PathLike) -> CSRMatrix:
    """Read a SciPy sparse ``.npz`` file into a validated CSR matrix.

    Raises
    ------
    MatrixFormatError
        Missing file, not a SciPy sparse archive, or invalid content.
    """
    import scipy.sparse as sp

    source = os.fspath(path)
    if not os.path.exists(path):
        raise MatrixFormatError(source, "no such file")
    try:
        a = sp.load_npz(source)
    except (ValueError, KeyError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise MatrixFormatError(source, f"not a SciPy sparse .npz file ({exc})") from None
    return csr_from_scipy(a, source)
