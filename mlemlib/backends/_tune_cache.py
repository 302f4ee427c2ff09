"""A cache of launch-shape tunings per matrix file, row block and device (host side: JSON files, no GPU).

:meth:`mlemlib.backends._cuda_kernels.DeviceCSR.tune` times ``csr_vector``
under every candidate shape (each its own NVRTC build) and keeps the fastest.
The winner depends on the matrix's rows, the lane count, the row layout, the
device and the kernels' code, so an entry's key holds all of them:

- the matrix file: its resolved path, size, modification time (ns) and the
  checksum its container records (:func:`file_identity`); a source that is
  not a file (an array in memory) has no identity and is never cached;
- what was tuned (``A``, ``AT``, ``AT (transposed on the GPU)``, a part) and its row range;
- the lanes per row, the row layout, the candidates' labels;
- the device (name, compute capability, CUDA runtime) and a digest of the kernels' source.

Any change gives another key: the entry is not found and the shapes are timed
again (and stored). An entry stores the key it was made for and is taken only
where that equals the key asked for, and its shape only where it is one of
the candidates now. A shape never changes a result (each row is summed by the
same code), so an entry can change a run's speed, never its image.

The cache is off unless a directory is given: the backends' ``tune_cache=``,
else the environment variable ``MLEM_TUNE_CACHE`` (:meth:`TuneCache.from_setting`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from mlemlib._io import atomic_path

log = logging.getLogger(__name__)

#: The environment variable that names the cache directory (unset or empty: no cache).
ENV = "MLEM_TUNE_CACHE"
#: Version of an entry's layout (part of the key).
VERSION = 1


def file_identity(source: Any) -> dict[str, Any] | None:
    """``{path, size, mtime_ns, checksum}`` of the file an opened matrix reads, or None for one that is not a file.

    ``source``: a reader with ``path`` or ``source`` naming a file (``MatrixH5``,
    ``Csr4File``, a ``.mtx``/``.npz`` read into memory), or a path.
    """
    if isinstance(source, (str, os.PathLike)):
        name: Any = source
    else:
        name = getattr(source, "path", None) or getattr(source, "source", None)
    if not isinstance(name, (str, os.PathLike)):
        return None
    try:
        path = Path(name).resolve()
        st = path.stat()
    except (OSError, ValueError):
        return None
    if not path.is_file():
        return None
    attrs = getattr(source, "attrs", None) or {}
    checksum = attrs.get("checksum") if isinstance(attrs, dict) else None
    checksum = checksum or getattr(source, "checksum", None)
    return {"path": os.fspath(path), "size": int(st.st_size), "mtime_ns": int(st.st_mtime_ns),
            "checksum": str(checksum) if checksum else None}


def source_key(source: Any, what: str, rows: tuple[int, int] | None = None) -> dict[str, Any] | None:
    """The matrix part of an entry's key: ``source``'s :func:`file_identity`, ``what`` was tuned and its
    ``rows`` (None: all); None where ``source`` is not a file (nothing is cached)."""
    identity = file_identity(source)
    if identity is None:
        return None
    return {"matrix": identity, "what": str(what), "rows": None if rows is None else [int(rows[0]), int(rows[1])]}


def tune_key(source: dict[str, Any], *, lanes: int, layout: int, candidates: list[str], device: dict[str, Any],
             kernels: str) -> dict[str, Any]:
    """An entry's whole key: :func:`source_key`'s part, the lanes, the row layout, the candidates' labels,
    the device's facts and the kernels' digest."""
    return {"version": VERSION, **source, "lanes": int(lanes), "layout": int(layout),
            "candidates": [str(c) for c in candidates], "device": dict(device), "kernels": str(kernels)}


def _canonical(key: dict[str, Any]) -> str:
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


class TuneCache:
    """Tuned launch shapes as one small JSON file per key in ``directory``.

    Reading never fails a run: a missing, unreadable or foreign entry is a
    miss. Writing is atomic (:func:`mlemlib._io.atomic_path`); a directory
    that cannot be written is logged and the run goes on.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)

    def __repr__(self) -> str:
        return f"TuneCache({os.fspath(self.directory)!r})"

    @classmethod
    def from_setting(cls, value: str | os.PathLike | TuneCache | None = None,
                     env: dict[str, str] | None = None) -> TuneCache | None:
        """The cache a backend uses: ``value`` (a directory or a cache), else ``$MLEM_TUNE_CACHE``; None (off)
        where neither names a directory."""
        if isinstance(value, TuneCache):
            return value
        if value is None:
            value = (os.environ if env is None else env).get(ENV) or None
        if value is None or not os.fspath(value).strip():
            return None
        return cls(value)

    def path(self, key: dict[str, Any]) -> Path:
        """The entry file of ``key`` (named by a digest of the key)."""
        digest = hashlib.sha256(_canonical(key).encode()).hexdigest()[:24]
        return self.directory / f"tune-{digest}.json"

    def get(self, key: dict[str, Any]) -> dict[str, Any] | None:
        """``{"best": label, "times_ms": {label: ms}}`` stored for ``key``, or None."""
        path = self.path(key)
        try:
            entry = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.debug("%s: unreadable tuning entry, tuning again: %s", path, exc)
            return None
        if not isinstance(entry, dict) or _canonical(entry.get("key") or {}) != _canonical(key):
            return None
        if not isinstance(entry.get("best"), str) or not isinstance(entry.get("times_ms"), dict):
            return None
        return {"best": entry["best"], "times_ms": entry["times_ms"]}

    def put(self, key: dict[str, Any], best: str, times_ms: dict[str, float]) -> Path | None:
        """Store the tuning of ``key``; the entry's path, or None where it could not be written (logged)."""
        path = self.path(key)
        entry = {"key": json.loads(_canonical(key)), "best": str(best),
                 "times_ms": {str(k): float(v) for k, v in times_ms.items()}}
        try:
            with atomic_path(path) as tmp:
                tmp.write_text(json.dumps(entry, indent=1, sort_keys=True) + "\n")
        except OSError as exc:
            log.warning("tuning cache %s not written: %s", path, exc)
            return None
        return path
