"""Reconstructed images on disk (host; NumPy, h5py): HDF5 with grid and voxel size, and raw float32.

- :func:`write_image` / :func:`read_image`: the ``mlem-image`` HDF5 layout
  (dataset ``/image``, shape ``(gridZ, gridY, gridX)`` where the grid is
  known) used for images, truths, references and checkpoints;
- :func:`write_raw`: ``nCols`` little-endian float32 values, no header, for the
  existing TUM tools.

Every write is atomic (temporary name, then rename); every read checks the
file and raises :class:`~mlemlib.errors.InputError` naming it and the fault.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from mlemlib._io import atomic_path
from mlemlib.errors import ConfigError, InputError

IMAGE_FORMAT = "mlem-image"
FORMAT_VERSION = 1

#: Column order of images (see :mod:`mlemlib.phantom`).
COLUMN_ORDER = "col = x + gridX*(y + gridY*z); image array shape (gridZ, gridY, gridX), C order"


def attr_value(v: Any) -> Any:
    """A Python value as an HDF5 attribute (dicts and non-numeric lists as JSON text)."""
    if isinstance(v, (dict, list, tuple)) and not (
        isinstance(v, (list, tuple)) and v and all(isinstance(x, (int, float, np.integer, np.floating)) for x in v)
    ):
        return json.dumps(v)
    if isinstance(v, Path):
        return os.fspath(v)
    return v


def write_image(
    path: str | os.PathLike,
    image: np.ndarray,
    *,
    grid: tuple[int, int, int] | None = None,
    voxel_size: tuple[float, float, float] | None = None,
    attrs: dict[str, Any] | None = None,
    others: dict[str, np.ndarray] | None = None,
) -> None:
    """Write an image as HDF5, atomically.

    ``others``: further images of the same length under ``/repetitions/<name>`` (flat), e.g. the other
    repetitions' images of a run with atomics by their SHA-256 (:func:`read_repetition_images`).

    Layout: dataset ``/image`` (float32, or float64 for a reference) of shape
    ``(gridZ, gridY, gridX)`` when ``grid`` is known, else ``(n,)``; attributes
    ``format="mlem-image"``, ``version``, ``column_order``, ``grid``
    (``gridX, gridY, gridZ``), ``voxel_size`` (mm), and ``attrs`` (None values
    skipped, dicts and lists of strings stored as JSON text).
    """
    import h5py

    a = np.asarray(image)
    if a.dtype not in (np.float32, np.float64):
        a = a.astype(np.float32)
    n = a.size
    if grid is not None:
        gx, gy, gz = (int(v) for v in grid)
        if gx * gy * gz != n:
            raise ConfigError("grid", f"grid {gx}x{gy}x{gz} does not hold {n} voxels")
        a = a.reshape(gz, gy, gx)
    else:
        a = a.reshape(-1)
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        f.create_dataset("image", data=a)
        for name, other in (others or {}).items():
            o = np.asarray(other).reshape(-1)
            if o.size != n:
                raise ConfigError("others", f"image {name!r} has {o.size} voxels, not {n}")
            f.create_dataset(f"repetitions/{name}", data=o.astype(a.dtype, copy=False))
        f.attrs["format"] = IMAGE_FORMAT
        f.attrs["version"] = FORMAT_VERSION
        f.attrs["column_order"] = COLUMN_ORDER
        if grid is not None:
            f.attrs["grid"] = np.asarray(grid, dtype=np.int64)
        if voxel_size is not None:
            f.attrs["voxel_size"] = np.asarray(voxel_size, dtype=np.float64)
        for k, v in (attrs or {}).items():
            if v is not None:
                f.attrs[k] = attr_value(v)


def plain_attr(v: Any) -> Any:
    """An HDF5 attribute as plain Python (str, list, int, float)."""
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    return v


def read_image(path: str | os.PathLike, expected_length: int | None = None) -> tuple[np.ndarray, dict[str, Any]]:
    """Read an image written by :func:`write_image` (image, truth, reference, checkpoint).

    Returns
    -------
    (numpy.ndarray, dict)
        The flat image (column order, its stored dtype) and its attributes.

    Raises
    ------
    InputError
        Missing or unreadable file, no ``/image`` dataset, wrong length, non-finite values.
    """
    import h5py

    source = os.fspath(path)
    if not os.path.isfile(source):
        raise InputError(source, "no such image file")
    try:
        f = h5py.File(source, "r")
    except OSError as exc:
        raise InputError(source, f"not a readable HDF5 file ({exc})") from None
    with f:
        if "image" not in f or not isinstance(f["image"], h5py.Dataset):
            raise InputError(source, "no dataset /image (expected an image written by mlem)")
        ds = f["image"]
        if ds.dtype.kind != "f":
            raise InputError(source, f"/image has dtype {ds.dtype}, expected float32 or float64")
        img = ds[...].reshape(-1)
        attrs = {k: plain_attr(v) for k, v in f.attrs.items()}
    if expected_length is not None and img.size != int(expected_length):
        raise InputError(source, f"image has {img.size} voxels, expected {int(expected_length)} (the matrix's columns)")
    if not np.isfinite(img).all():
        raise InputError(source, "image holds non-finite values")
    return img, attrs


def write_raw(path: str | os.PathLike, image: np.ndarray) -> None:
    """Write the image as raw little-endian float32, nCols values, no header (the existing tools' format)."""
    with atomic_path(path) as tmp:
        np.ascontiguousarray(np.asarray(image).reshape(-1), dtype="<f4").tofile(tmp)


def read_repetition_images(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The other repetitions' images an ``image.h5`` keeps (``/repetitions/<SHA-256>``, flat); {} where none."""
    import h5py

    with h5py.File(os.fspath(path), "r") as f:
        group = f.get("repetitions")
        return {} if group is None else {name: ds[...].reshape(-1) for name, ds in group.items()}
