"""The measurement's correction factors: multiplicative ``m`` and additive ``b`` per LOR (host, NumPy).

The forward model of the expected counts is ``ybar = m * (A f) + b``
(docs/reconstruction.md): ``m`` are attenuation x normalisation
factors (dimensionless, 1 when not given), ``b`` the expected background
counts (randoms + scatter, in counts like ``g``, 0 when not given).

A folded matrix (:mod:`mlemlib.fold`) stores once each group ``L_r`` of LORs
whose rows of ``A`` are equal, and its measurement is their counts' sum
``G_r = sum_{i in L_r} g_i``. ``G_r`` is Poisson with mean
``M_r (A f)_r + B_r``, ``M_r = sum_{i in L_r} m_i`` and
``B_r = sum_{i in L_r} b_i``: the folded run models these per stored row
(:func:`summed_factors`), exactly the unfolded model for ``b = 0`` and the
maximum-likelihood image of the summed counts otherwise.

Provides

- :func:`read_factors` — one file of them: raw little-endian float32, one per
  LOR, no header (as ``.LMsino`` is int32), or an HDF5 dataset
  (``file.h5:/path``, or the file's single dataset); refused in one line
  naming the file and the fault: wrong length, NaN or Inf, a negative value,
  ``m`` all zero.
- :func:`background` — what the backends add to the forward projection:
  ``b' = b / m`` (float64, then float32), ``+inf`` where ``m = 0`` (a gap: the
  LOR does not count, ``g / inf = 0``). Then ``g / (A f + b') = m g / ybar``.
- :func:`summed_factors` — a folded matrix's ``m`` and ``b`` per stored row:
  the sums over the LORs each stored row stands for (the folded model below).
- :func:`stored_values` — per-LOR labels on a folded matrix's stored rows
  (one per stored row: shared by its LORs, or its first LOR's).
- :func:`factors_checksum` — the identity of a factor vector (run keys, norms).
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mlemlib.errors import ConfigError

log = logging.getLogger(__name__)

#: The two kinds of factor files and what a message calls them.
KINDS = {"multiplicative": "multiplicative factor", "additive": "additive background"}


def split_h5(spec: str) -> tuple[str, str | None]:
    """``file.h5:/path`` -> (file, path); a plain file name -> (file, None)."""
    for suffix in (".h5:", ".hdf5:", ".hdf:"):
        at = spec.lower().find(suffix)
        if at >= 0:
            cut = at + len(suffix) - 1
            return spec[:cut], spec[cut + 1 :] or None
    return spec, None


def _is_h5(path: str) -> bool:
    with open(path, "rb") as fh:
        return fh.read(8) == b"\x89HDF\r\n\x1a\n"


def _read_h5(path: str, dataset: str | None, spec: str) -> np.ndarray:
    import h5py

    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise ConfigError(spec, f"not a readable HDF5 file ({exc})") from None
    with f:
        if dataset is None:
            names: list[str] = []
            f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
            if len(names) != 1:
                raise ConfigError(spec, f"holds {len(names)} datasets; name one as {path}:/dataset")
            dataset = names[0]
        if dataset not in f or not isinstance(f[dataset], h5py.Dataset):
            raise ConfigError(spec, f"no dataset {dataset!r}")
        ds = f[dataset]
        if ds.dtype.kind not in "fiu":
            raise ConfigError(spec, f"dataset {dataset!r} has dtype {ds.dtype}, expected numbers")
        return np.asarray(ds[()]).reshape(-1)


def read_factors(spec: Any, m: int, kind: str) -> np.ndarray:
    """One factor per LOR (float32[m], the user's LOR order) from a file or an array.

    Parameters
    ----------
    spec
        A raw float32 file, ``file.h5:/dataset``, an HDF5 file with one
        dataset, or an array.
    m
        The user's LOR count (the measurement's length).
    kind
        ``multiplicative`` or ``additive``.

    Raises
    ------
    ConfigError
        One line naming the file: missing, a size that is not whole float32
        values, the wrong length, NaN or Inf, a negative value, ``m`` all zero.
    """
    if kind not in KINDS:
        raise ConfigError("kind", f"{kind!r}, expected one of {', '.join(KINDS)}")
    if isinstance(spec, np.ndarray):
        name, values = f"<{kind} array>", spec.reshape(-1)
    else:
        name = os.fspath(spec)
        values = read_float32_file(name, KINDS[kind], "LOR")
    return check_factors(values, m, kind, name)


def read_float32_file(spec: str | os.PathLike, what: str, per: str) -> np.ndarray:
    """The values of a raw little-endian float32 file, of ``file.h5:/dataset``, or of an HDF5 file holding one
    dataset (read flat, C order), unchecked.

    Raises
    ------
    ConfigError
        One line naming the file: missing (``no such <what> file``), or a raw file whose size is not whole
        float32 values (one per ``per``).
    """
    name = os.fspath(spec)
    path, dataset = split_h5(name)
    if not Path(path).is_file():
        raise ConfigError(name, f"no such {what} file")
    if dataset is not None or _is_h5(path):
        return _read_h5(path, dataset, name)
    size = Path(path).stat().st_size
    if size % 4:
        raise ConfigError(name, f"size {size} is not a multiple of 4 bytes (raw little-endian float32 per {per})")
    return np.fromfile(path, dtype="<f4")


def check_factors(values: Any, m: int, kind: str, name: str) -> np.ndarray:
    """``values`` as float32[m] after the checks of :func:`read_factors` (one line naming ``name``)."""
    v = np.asarray(values).reshape(-1)
    if v.size != m:
        raise ConfigError(name, f"{v.size} {KINDS[kind]}s, expected one per LOR ({m}, the measurement's length)")
    v = v.astype(np.float32)
    finite = np.isfinite(v)
    if not finite.all():
        i = int(np.argmax(~finite))
        raise ConfigError(name, f"{KINDS[kind]} {float(v[i])} at LOR {i} (NaN or Inf)")
    if (v < 0).any():
        i = int(np.argmax(v < 0))
        raise ConfigError(name, f"negative {KINDS[kind]} {float(v[i])} at LOR {i}")
    if kind == "multiplicative" and m and not v.any():
        raise ConfigError(name, "every multiplicative factor is 0: no LOR counts")
    return v


def background(m: np.ndarray | None, b: np.ndarray | None, rows: int, dtype: Any = np.float32) -> np.ndarray:
    """``b' = b / m`` per row: computed in float64, then rounded to ``dtype`` (float32 for every backend; the
    float64 reference keeps float64); ``+inf`` where ``m == 0``.

    ``m`` None means 1 everywhere, ``b`` None 0 everywhere (with a gap in
    ``m`` the background is still needed to mark it: ``b'`` is all zeros
    but the gaps).
    """
    m64 = np.ones(rows) if m is None else np.asarray(m, dtype=np.float64)
    b64 = np.zeros(rows) if b is None else np.asarray(b, dtype=np.float64)
    out = np.full(rows, np.inf)
    np.divide(b64, m64, out=out, where=m64 > 0)
    return out.astype(dtype)


def summed_factors(fold: Any, m: np.ndarray | None, b: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """A folded matrix's factors per stored row: ``M_r = sum_{i in L_r} m_i`` and ``B_r = sum_{i in L_r} b_i``
    (float64, the fold's stored-row order), ``L_r`` the LORs stored row ``r`` stands for.

    A stored row holds the values of one row of ``A``, once, and stands for
    its ``|L_r|`` LORs; its measurement is their counts' sum ``G_r``
    (:meth:`mlemlib.fold.RowFold.fold`). ``G_r`` is Poisson with mean
    ``sum_{i in L_r} (m_i (A f)_r + b_i) = M_r (A f)_r + B_r``. So the folded
    run weights row ``r`` by ``M_r`` in the sensitivities (for m = 1, ``M_r``
    is the row's multiplicity ``|L_r|``: the fold's weights of the plain norm)
    and adds ``b'_r = B_r / M_r`` to its forward projection
    (:func:`background`): ``G_r / ((A f)_r + b'_r) = M_r G_r / ybar_r``, the
    folded ``c_r``. With ``b = 0`` this is the unfolded run, term for term:
    ``sum_{i in L_r} a_rj m_i g_i / (m_i (A f)_r) = a_rj G_r / (A f)_r`` and
    ``sum_{i in L_r} a_rj m_i = a_rj M_r`` (where a gap, ``m_i = 0``, holds
    no counts, as the model expects with ``b = 0``: the unfolded run ignores a
    gap's count, the folded one sums it into ``G_r``). A row whose LORs are all
    gaps has ``M_r = 0``: ``b'_r = +inf``, it does not count.

    Parameters
    ----------
    fold
        The matrix's :class:`~mlemlib.fold.RowFold`.
    m, b
        Per-LOR factors in the user's LOR order (None: 1 and 0 everywhere).

    Returns
    -------
    (M, B)
        float64[m_stored] each; ``B`` None where ``b`` is None.
    """
    if m is None:
        big_m = fold.multiplicity().astype(np.float64)
    else:
        big_m = fold.fold(np.asarray(m, dtype=np.float64), "multiplicative")
    big_b = None if b is None else fold.fold(np.asarray(b, dtype=np.float64), "additive")
    return big_m, big_b


def stored_values(values: np.ndarray, fold: Any, source: str | os.PathLike, what: str, *,
                  first: bool = False) -> np.ndarray:
    """Per-LOR ``values`` (the user's rows, e.g. subset labels) on a folded matrix's stored rows.

    Each stored row takes its LORs' value. Where they differ (a content fold
    merges LORs of different angles whose rows of ``A`` are equal) it takes
    its first LOR's value with ``first``, and is refused otherwise.

    Raises
    ------
    ConfigError
        Naming ``source``: two LORs of one stored row with different values (``first`` False).
    """
    rm = np.asarray(fold.row_map)
    users = np.flatnonzero(rm >= 0)
    values = np.asarray(values)
    _, first_lor = np.unique(rm[users], return_index=True)  # every stored row is some LOR's (RowFold.check)
    out = values[users[first_lor]]
    differ = out[rm[users]] != values[users]
    if differ.any() and first:
        log.info("%s: %d stored row(s) stand for LORs of different %ss (equal rows of A): each takes its "
                 "first LOR's", source, int(np.unique(rm[users][differ]).size), what)
    elif differ.any():
        i = int(users[np.argmax(differ)])
        raise ConfigError(source, f"LOR {i} has {what} {values[i]}, another LOR of its stored row has {out[rm[i]]} "
                                  f"(the matrix is folded: a stored row takes one {what}); use an unfolded matrix")
    return out


def factors_checksum(values: np.ndarray | None) -> str:
    """blake2b-128 of the float32 values' little-endian bytes (hex); ``""`` for None (not given)."""
    if values is None:
        return ""
    return hashlib.blake2b(np.ascontiguousarray(values, dtype="<f4").tobytes(), digest_size=16).hexdigest()


@dataclass
class Corrections:
    """What one run models beyond MLEM: its subsets, its background ``b'`` and the sensitivities' row weights.

    All in the backend's row order (a reordered matrix's rows). The defaults are MLEM (S = 1, m = 1, b = 0).
    """

    #: S, and how the rows were assigned to subsets (``mlemlib.subsets.METHODS``; ``""`` for S = 1).
    subsets: int = 1
    method: str = ""
    #: int64[S+1] row bounds of the subsets (None: S = 1), and the labels' checksum (which rows form which subset).
    bounds: np.ndarray | None = None
    labels: str = ""
    #: float32[m] ``b' = b / m`` (+inf at a gap), or None (m = 1 and b = 0).
    background: np.ndarray | None = None
    #: float64[m] each row's weight in the sensitivities (``m``; a folded row's ``M_r``, :func:`summed_factors`),
    #: or None (all 1).
    weights: np.ndarray | None = None
    #: Checksums of the factors (``""``: not given) and the files they came from.
    multiplicative: str = ""
    additive: str = ""
    files: dict[str, str | None] = field(default_factory=dict)

    @property
    def plain(self) -> bool:
        """True for MLEM with m = 1 and b = 0 (the norm and the backend as without corrections)."""
        return self.bounds is None and not self.multiplicative and not self.additive

    def identity(self) -> str:
        """What the corrections change of the problem (its fingerprint's part), ``""`` for MLEM."""
        if self.plain:
            return ""
        return f"subsets={self.subsets}:{self.labels};m={self.multiplicative};b={self.additive}"

    def record(self) -> dict[str, Any]:
        """``timings.json``'s account: S, the method, the files and their checksums."""
        return {"subsets": self.subsets, "subset_method": self.method or None, "subset_labels": self.labels or None,
                "subset_file": self.files.get("subset_file"),
                "multiplicative": self.files.get("multiplicative"), "multiplicative_checksum": self.multiplicative or None,
                "additive": self.files.get("additive"), "additive_checksum": self.additive or None}
