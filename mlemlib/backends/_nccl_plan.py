"""Host-side planning of the ``cuda-nccl`` backend (no GPU): its partition plan (its kernels are
:func:`mlemlib.registry.decide`'s, as every backend's).

:func:`build_plan` reads a partition plan (checked against the matrix) or splits the rows in memory
with the partition stage's rule.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mlemlib.errors import ConfigError, MatrixFormatError
from mlemlib.matrix import CSRMatrix, shape_nnz


def plan_has_parts(plan: Any) -> bool:
    """Whether a plan (path, directory or dict; None: split in memory) names each part's ``A_k^T`` file."""
    if plan is None:
        return False
    from mlemlib import partition

    d = dict(plan) if isinstance(plan, dict) else partition.read_plan(plan)
    return bool(d.get("local_transpose"))


def indptr_of(source: Any) -> np.ndarray:
    """The full row pointer of a matrix source (host int64)."""
    if isinstance(source, CSRMatrix):
        ip = np.asarray(source.indptr, dtype=np.int64)
        return ip - ip[0] if len(ip) and ip[0] else ip
    if hasattr(source, "read_indptr"):
        return np.asarray(source.read_indptr(), dtype=np.int64)
    if hasattr(source, "csr_indptr"):  # an in-memory compressed matrix: its elements' row pointer
        return np.asarray(source.csr_indptr(), dtype=np.int64)
    if hasattr(source, "tocsr"):
        return np.asarray(source.tocsr().indptr, dtype=np.int64)
    ip = getattr(source, "indptr", None)
    if ip is not None and hasattr(ip, "get"):  # DeviceCSR
        return np.asarray(ip.get(), dtype=np.int64)
    raise TypeError(f"cannot read the row pointer of {type(source).__name__}")


def build_plan(matrix: Any, transpose: Any | None, parts: int, plan: Any | None, layout: str) -> dict:
    """The partition plan of a run: read (and checked against the matrix) or computed in memory.

    Parameters
    ----------
    matrix, transpose
        The sources of ``A`` and ``A^T`` (transpose may be None).
    parts
        Number of GPUs (parts).
    plan
        A ``plan.json`` path or directory, a plan dict, or None to split
        here with the partition stage's rule
        (:func:`mlemlib.partition.make_plan`).
    layout
        ``local`` or ``thesis``; ``thesis`` needs ``transpose_rows``.

    Raises
    ------
    ConfigError
        The plan has another number of parts, or the thesis layout lacks the
        row blocks of ``A^T``.
    MatrixFormatError
        The plan does not describe this matrix.
    """
    from mlemlib import partition

    (m, n), nnz = shape_nnz(matrix)
    if plan is None:
        t_ip = indptr_of(transpose) if transpose is not None else None
        out = partition.make_plan(indptr_of(matrix), t_ip, parts, (m, n))
    else:
        out = dict(plan) if isinstance(plan, dict) else partition.read_plan(plan)
        where = out.get("plan", "<plan>")
        if int(out["parts"]) != parts:
            raise ConfigError(
                where, f"plan has {out['parts']} parts but the run uses {parts} GPUs: partition with --parts {parts}"
            )
        if [int(v) for v in out["shape"]] != [m, n] or int(out["nnz"]) != nnz:
            raise MatrixFormatError(
                where, f"plan is for a {tuple(out['shape'])} matrix with {out['nnz']} nnz, not {(m, n)} with {nnz}"
            )
    if layout == "thesis" and "transpose_rows" not in out:
        raise ConfigError("layout", "layout=thesis needs the transpose (A^T): give --transpose or a plan made with one")
    return out
