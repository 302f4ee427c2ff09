"""Checkpoints of an MLEM run: the image after an iteration, tied to its problem (host; all backends).

A checkpoint is a small HDF5 file (``format="mlem-checkpoint"``) holding
``/image`` and, as attributes, the repetition and iteration it was taken
after, the loop's state (JSON: configuration, finished repetitions' records,
step-time samples) and a key: the hash of the problem (:func:`checkpoint_key`
of the matrix and measurement fingerprint, the norm and the precision). It is
written atomically; :func:`read_checkpoint` refuses one of another problem,
:func:`read_resume` also one beyond the run, in one line naming the file.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import numpy as np

from mlemlib._io import atomic_path
from mlemlib.errors import ConfigError
from mlemlib.image import FORMAT_VERSION, plain_attr
from mlemlib.provenance import dumps, sha, utc_now

log = logging.getLogger(__name__)

#: ``format`` attribute of a checkpoint file.
CHECKPOINT_FORMAT = "mlem-checkpoint"


def checkpoint_key(problem: str, norm: np.ndarray, dtype: np.dtype) -> str:
    """The key of a checkpoint: the problem's fingerprint, the norm and the image's precision, hashed."""
    return sha("checkpoint", problem, np.ascontiguousarray(norm, dtype=np.float64).tobytes(), str(np.dtype(dtype)))


def write_checkpoint(path: str | os.PathLike, image: np.ndarray, *, key: str, repetition: int, iteration: int, state: dict[str, Any]) -> None:
    """Write a checkpoint atomically: ``/image`` plus the iteration, repetition, input hash and loop state."""
    import h5py

    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        f.create_dataset("image", data=np.asarray(image).reshape(-1))
        f.attrs["format"] = CHECKPOINT_FORMAT
        f.attrs["version"] = FORMAT_VERSION
        f.attrs["key"] = key
        f.attrs["repetition"] = int(repetition)
        f.attrs["iteration"] = int(iteration)
        f.attrs["state"] = dumps(state)
        f.attrs["created"] = utc_now()


def read_checkpoint(path: str | os.PathLike, *, key: str, n: int, dtype: np.dtype) -> dict[str, Any]:
    """Load a checkpoint and check that it belongs to this problem.

    Returns
    -------
    dict
        ``image``, ``repetition``, ``iteration``, ``state``.

    Raises
    ------
    ConfigError
        The checkpoint belongs to another problem (other matrix, measurement,
        norm or precision), or is not a checkpoint.
    """
    import h5py

    source = os.fspath(path)
    try:
        f = h5py.File(source, "r")
    except OSError as exc:
        raise ConfigError(source, f"not a readable checkpoint ({exc}); delete it to start afresh") from None
    with f:
        fmt = plain_attr(f.attrs.get("format", ""))
        if fmt != CHECKPOINT_FORMAT or "image" not in f:
            raise ConfigError(source, f"not an mlem checkpoint (format {fmt!r}); delete it or choose another --checkpoint")
        found = plain_attr(f.attrs.get("key", ""))
        if found != key:
            raise ConfigError(
                source,
                f"checkpoint of another problem (inputs hash {found[:12]}..., this run {key[:12]}...: "
                "matrix, measurement, norm or precision differ); delete it to start afresh",
            )
        img = f["image"][...]
        if img.size != n or img.dtype != np.dtype(dtype):
            raise ConfigError(source, f"checkpoint image is {img.dtype}[{img.size}], expected {np.dtype(dtype)}[{n}]")
        return {
            "image": img,
            "repetition": int(f.attrs["repetition"]),
            "iteration": int(f.attrs["iteration"]),
            "state": json.loads(plain_attr(f.attrs["state"])),
        }


def read_resume(path: str | os.PathLike, *, key: str, n: int, dtype: np.dtype, repetitions: int,
                iterations: int) -> dict[str, Any]:
    """The state a run resumes from (checked before the backend is built: a refused checkpoint costs no set-up).

    Returns
    -------
    dict
        ``config``, ``records``, ``repetition``, ``iteration``, ``image``,
        ``samples`` (the repetition's step times so far) and ``resumed_at``
        (the iterations this repetition was resumed after, this one included).

    Raises
    ------
    ConfigError
        A checkpoint of another problem (:func:`read_checkpoint`), or one
        beyond this run's repetitions and iterations.
    """
    ck = read_checkpoint(path, key=key, n=n, dtype=dtype)
    if ck["repetition"] >= repetitions or ck["iteration"] > iterations:
        raise ConfigError(
            os.fspath(path),
            f"checkpoint at repetition {ck['repetition'] + 1}, iteration {ck['iteration']} is beyond this run "
            f"({repetitions} repetitions of {iterations} iterations); delete it to start afresh",
        )
    state = ck["state"]
    log.info("resuming from %s: repetition %d, iteration %d", path, ck["repetition"] + 1, ck["iteration"])
    return {
        "config": state.get("config", {}),
        "records": state.get("records", []),
        "repetition": ck["repetition"],
        "iteration": ck["iteration"],
        "image": ck["image"],
        "samples": state.get("samples", {}),
        "resumed_at": state.get("resumed_at", []) + [ck["iteration"]],
    }
