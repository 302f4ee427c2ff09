"""Analytic 3D phantoms on the scanner's voxel grid, and measurement simulation (host, NumPy/Numba).

Phantoms
--------
A phantom is a list of solid shapes (:class:`Cylinder` along z,
:class:`Sphere`), painted in order (a later shape overwrites an earlier one),
in millimetres, with the field of view centred on the origin. Each is scaled
to the grid: ``R = min(gridX*w, gridY*h) / 2`` is the transaxial half-width
and ``H = gridZ*d / 2`` the axial half-length of the field of view.

- ``uniform``: a cylinder of radius 0.85 R and length 1.8 H, activity 1.
- ``nema``: NEMA image-quality-like: the same cylinder (activity 1), a cold
  central "lung" insert (radius 0.12 R, activity 0) and six spheres on a
  ring of radius 0.5 R in the central plane, diameters in the ratio
  10:13:17:22:28:37 (the largest of radius min(0.22 R, 0.8 H)); the four smallest are hot
  (activity 4, i.e. 4:1), the two largest cold (activity 0).
- ``derenzo``: a cold cylinder (activity 0) holding six 60-degree sectors of
  hot rods (activity 1) along z; rod diameters 0.05, 0.065, 0.08, 0.10, 0.125,
  0.16 R, centre spacing twice the diameter.

Voxel values are the mean activity over ``supersample**3`` points per voxel
(antialiasing). Images have shape ``(gridZ, gridY, gridX)`` in C order, so
``image.reshape(-1)[col]`` is column ``col = x + gridX*(y + gridY*z)`` of the
system matrix: x varies fastest, as in the ``.csr4`` scanner grid.

Simulation
----------
:func:`simulate` forward-projects a phantom through the system matrix
(streaming row blocks, float64 accumulation), scales the expectation to a
total count and draws Poisson counts with a seeded :class:`numpy.random.Generator`
(or rounds the expectation: ``noiseless``). It writes the ``.LMsino`` and
``truth.h5``: the phantom scaled by the same factor, so that ``A @ truth`` is
the expected measurement and reconstructions compare with it directly.
Given a reordered matrix (``mlem reorder``) it writes both in the user's
order (LORs and voxels of the matrix the permutation was computed from).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from mlemlib.errors import ConfigError, MatrixFormatError

log = logging.getLogger(__name__)

#: Names accepted by :func:`make_phantom`.
PHANTOMS = ("nema", "derenzo", "uniform")

#: Total expected counts of a simulated measurement unless ``counts`` is given.
DEFAULT_COUNTS = 10_000_000

#: Column order of images, written into every image file.
COLUMN_ORDER = "col = x + gridX*(y + gridY*z); image array shape (gridZ, gridY, gridX), C order"

_NEMA_DIAMETERS = (10.0, 13.0, 17.0, 22.0, 28.0, 37.0)
_DERENZO_DIAMETERS = (0.05, 0.065, 0.08, 0.10, 0.125, 0.16)


# --------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class Sphere:
    """A solid sphere: centre ``(x, y, z)`` and radius in mm, activity ``value``."""

    center: tuple[float, float, float]
    radius: float
    value: float
    label: str = ""
    kind: str = field(default="sphere", init=False)

    def inside(self, x: np.ndarray, y: np.ndarray, z: float) -> np.ndarray:
        """Boolean mask of the points ``(x, y, z)`` inside (boundary included)."""
        cx, cy, cz = self.center
        return (x - cx) ** 2 + (y - cy) ** 2 + (z - cz) ** 2 <= self.radius**2

    def bbox(self) -> tuple[tuple[float, float], tuple[float, float], tuple[float, float]]:
        """Axis-aligned bounding box ``((x0, x1), (y0, y1), (z0, z1))``."""
        cx, cy, cz = self.center
        r = self.radius
        return (cx - r, cx + r), (cy - r, cy + r), (cz - r, cz + r)

    def volume(self) -> float:
        """Analytic volume in mm^3."""
        return 4.0 / 3.0 * math.pi * self.radius**3


@dataclass(frozen=True)
class Cylinder:
    """A solid cylinder along z: axis at ``(x, y)``, radius, axial extent ``[z0, z1]`` in mm."""

    center: tuple[float, float]
    radius: float
    z0: float
    z1: float
    value: float
    label: str = ""
    kind: str = field(default="cylinder", init=False)

    def inside(self, x: np.ndarray, y: np.ndarray, z: float) -> np.ndarray:
        """Boolean mask of the points ``(x, y, z)`` inside (boundary included)."""
        if not (self.z0 <= z <= self.z1):
            return np.zeros(np.broadcast(x, y).shape, dtype=bool)
        cx, cy = self.center
        return (x - cx) ** 2 + (y - cy) ** 2 <= self.radius**2

    def bbox(self) -> tuple[tuple[float, float], tuple[float, float], tuple[float, float]]:
        """Axis-aligned bounding box ``((x0, x1), (y0, y1), (z0, z1))``."""
        cx, cy = self.center
        r = self.radius
        return (cx - r, cx + r), (cy - r, cy + r), (self.z0, self.z1)

    def volume(self) -> float:
        """Analytic volume in mm^3."""
        return math.pi * self.radius**2 * (self.z1 - self.z0)


Shape = Sphere | Cylinder


@dataclass
class Phantom:
    """A named phantom: shapes painted in order; ``shapes[0]`` is the body (background)."""

    name: str
    shapes: list[Shape]

    @property
    def body(self) -> Shape:
        return self.shapes[0]

    def to_json(self) -> str:
        """The geometry as JSON (stored in ``truth.h5`` as attribute ``regions``)."""
        return json.dumps({"name": self.name, "shapes": [asdict(s) for s in self.shapes]})

    @classmethod
    def from_json(cls, text: str) -> Phantom:
        """Inverse of :meth:`to_json`."""
        d = json.loads(text)
        shapes: list[Shape] = []
        for s in d["shapes"]:
            s = dict(s)
            kind = s.pop("kind")
            if kind == "sphere":
                shapes.append(Sphere(tuple(s["center"]), s["radius"], s["value"], s.get("label", "")))
            elif kind == "cylinder":
                shapes.append(
                    Cylinder(tuple(s["center"]), s["radius"], s["z0"], s["z1"], s["value"], s.get("label", ""))
                )
            else:
                raise ValueError(f"unknown shape kind {kind!r}")
        return cls(d["name"], shapes)


def _check_grid(grid: Sequence[int], voxel_size: Sequence[float]) -> tuple[tuple[int, int, int], tuple[float, float, float]]:
    try:
        g = tuple(int(v) for v in grid)
        vs = tuple(float(v) for v in voxel_size)
    except (TypeError, ValueError) as exc:
        raise ConfigError("grid", f"grid {grid!r} / voxel size {voxel_size!r} are not numbers: {exc}") from None
    if len(g) != 3 or min(g) < 1:
        raise ConfigError("grid", f"grid must be 3 positive integers (gridX, gridY, gridZ), got {tuple(grid)}")
    if len(vs) != 3 or not all(math.isfinite(v) and v > 0 for v in vs):
        raise ConfigError("voxel_size", f"voxel size must be 3 positive numbers (w, h, d) in mm, got {tuple(voxel_size)}")
    return g, vs  # type: ignore[return-value]


def phantom_shapes(name: str, grid: Sequence[int], voxel_size: Sequence[float]) -> Phantom:
    """The geometry of a named phantom scaled to a grid (see the module docstring).

    Parameters
    ----------
    name
        ``"nema"``, ``"derenzo"`` or ``"uniform"``.
    grid
        ``(gridX, gridY, gridZ)`` voxels.
    voxel_size
        ``(w, h, d)`` in mm.

    Raises
    ------
    ConfigError
        For an unknown name or a bad grid.
    """
    (gx, gy, gz), (vx, vy, vz) = _check_grid(grid, voxel_size)
    R = 0.5 * min(gx * vx, gy * vy)
    H = 0.5 * gz * vz
    body_r, z0, z1 = 0.85 * R, -0.9 * H, 0.9 * H
    if name == "uniform":
        return Phantom(name, [Cylinder((0.0, 0.0), body_r, z0, z1, 1.0, "background")])
    if name == "nema":
        shapes: list[Shape] = [
            Cylinder((0.0, 0.0), body_r, z0, z1, 1.0, "background"),
            Cylinder((0.0, 0.0), 0.12 * R, z0, z1, 0.0, "lung"),
        ]
        r_max = min(0.22 * R, 0.8 * H)
        ring = 0.5 * R
        for k, d in enumerate(_NEMA_DIAMETERS):
            r = r_max * d / _NEMA_DIAMETERS[-1]
            hot = k < 4
            ang = math.radians(60.0 * k + 90.0)
            label = f"hot{k + 1}" if hot else f"cold{k - 3}"
            shapes.append(Sphere((ring * math.cos(ang), ring * math.sin(ang), 0.0), r, 4.0 if hot else 0.0, label))
        return Phantom(name, shapes)
    if name == "derenzo":
        shapes = [Cylinder((0.0, 0.0), body_r, z0, z1, 0.0, "background")]
        limit = 0.8 * R
        for k, frac in enumerate(_DERENZO_DIAMETERS):
            d = frac * R
            r = d / 2.0
            a = 2.0 * d  # centre spacing
            t1 = math.radians(60.0 * k + 90.0)
            t2 = t1 + math.radians(60.0)
            tb = t1 + math.radians(30.0)
            u1 = np.array([math.cos(t1), math.sin(t1)])
            u2 = np.array([math.cos(t2), math.sin(t2)])
            # Shift the wedge's apex along its bisector so that rods stay clear of
            # the centre and of the neighbouring sectors (distance to the sector's
            # edges is delta/2).
            delta = 1.2 * d + 0.04 * R
            apex = delta * np.array([math.cos(tb), math.sin(tb)])
            j = 0
            while True:
                placed = False
                for i in range(j + 1):
                    p = apex + a * ((j - i) * u1 + i * u2)
                    if math.hypot(p[0], p[1]) + r <= limit:
                        shapes.append(Cylinder((float(p[0]), float(p[1])), r, z0, z1, 1.0, f"rods{k + 1}"))
                        placed = True
                if not placed and j > 0:
                    break
                j += 1
                if j > 10_000:  # pragma: no cover - cannot happen with limit > 0
                    break
        return Phantom(name, shapes)
    raise ConfigError("phantom", f"unknown phantom {name!r}, expected one of {', '.join(PHANTOMS)}")


# --------------------------------------------------------------------------- rasterisation
def _centres(n: int, size: float) -> np.ndarray:
    """Voxel-centre coordinates (mm) of one axis, centred on 0."""
    return (np.arange(n, dtype=np.float64) + 0.5 - n / 2.0) * size


def _fine_axis(n: int, size: float, s: int) -> np.ndarray:
    """Sub-sample coordinates (mm) of one axis: ``s`` points per voxel, at sub-cell centres."""
    return ((np.arange(n * s, dtype=np.float64) + 0.5) / s - n / 2.0) * size


def _index_range(lo: float, hi: float, coords: np.ndarray) -> tuple[int, int]:
    """Indices ``[a, b)`` of the sorted ``coords`` inside ``[lo, hi]``."""
    a = int(np.searchsorted(coords, lo, side="left"))
    b = int(np.searchsorted(coords, hi, side="right"))
    return a, b


def rasterize(
    shapes: Sequence[Shape], grid: Sequence[int], voxel_size: Sequence[float], *, supersample: int = 3
) -> np.ndarray:
    """Paint shapes on the grid with ``supersample**3`` points per voxel.

    Parameters
    ----------
    shapes
        Painted in order; a later shape overwrites an earlier one; outside all shapes is 0.
    grid, voxel_size
        ``(gridX, gridY, gridZ)`` and ``(w, h, d)`` mm.
    supersample
        Points per voxel and axis (1 = voxel centres only).

    Returns
    -------
    numpy.ndarray
        float32, shape ``(gridZ, gridY, gridX)``: the mean value of the points of each voxel.
    """
    (gx, gy, gz), (vx, vy, vz) = _check_grid(grid, voxel_size)
    s = int(supersample)
    if s < 1:
        raise ConfigError("supersample", f"must be >= 1, got {supersample}")
    xs, ys, zs = _fine_axis(gx, vx, s), _fine_axis(gy, vy, s), _fine_axis(gz, vz, s)
    boxes = []
    for sh in shapes:
        (x0, x1), (y0, y1), (z0, z1) = sh.bbox()
        boxes.append((_index_range(x0, x1, xs), _index_range(y0, y1, ys), _index_range(z0, z1, zs)))
    out = np.empty((gz, gy, gx), dtype=np.float32)
    plane = np.empty((gy * s, gx * s), dtype=np.float64)
    acc = np.empty((gy, gx), dtype=np.float64)
    for iz in range(gz):
        acc[:] = 0.0
        for kz in range(iz * s, (iz + 1) * s):
            z = zs[kz]
            plane[:] = 0.0
            for sh, ((ax, bx), (ay, by), (az, bz)) in zip(shapes, boxes):
                if not (az <= kz < bz) or ax >= bx or ay >= by:
                    continue
                sub = plane[ay:by, ax:bx]
                mask = sh.inside(xs[None, ax:bx], ys[ay:by, None], z)
                sub[mask] = sh.value
            acc += plane.reshape(gy, s, gx, s).mean(axis=(1, 3))
        out[iz] = acc / s
    return out


def make_phantom(
    name: str, grid: Sequence[int], voxel_size: Sequence[float], *, supersample: int = 3
) -> np.ndarray:
    """A named phantom as a float32 image of shape ``(gridZ, gridY, gridX)``.

    Parameters
    ----------
    name
        ``"nema"``, ``"derenzo"`` or ``"uniform"``.
    grid
        ``(gridX, gridY, gridZ)`` (the matrix's ``grid`` attribute).
    voxel_size
        ``(w, h, d)`` mm (the matrix's ``voxel_size`` attribute).
    supersample
        Points per voxel and axis for antialiasing.

    Returns
    -------
    numpy.ndarray
        Activity per voxel (background 1 for ``nema``/``uniform``); ``reshape(-1)``
        gives the matrix's column order.
    """
    return rasterize(phantom_shapes(name, grid, voxel_size).shapes, grid, voxel_size, supersample=supersample)


# --------------------------------------------------------------------------- regions
@dataclass
class RegionMasks:
    """Masks for contrast recovery: one per insert, plus the background."""

    masks: dict[str, np.ndarray]
    background: np.ndarray
    activity: dict[str, float]
    background_activity: float


def _voxel_bounds(grid: tuple[int, int, int], voxel_size: tuple[float, float, float]):
    (gx, gy, gz), (vx, vy, vz) = grid, voxel_size
    cx, cy, cz = _centres(gx, vx), _centres(gy, vy), _centres(gz, vz)
    return (cx, vx / 2), (cy, vy / 2), (cz, vz / 2)


def _far_near(c: np.ndarray, half: float, p: float) -> tuple[np.ndarray, np.ndarray]:
    """Per-axis distance from ``p`` to the farthest and the nearest point of each voxel interval."""
    far = np.maximum(np.abs(c - half - p), np.abs(c + half - p))
    near = np.maximum(0.0, np.abs(c - p) - half)
    return far, near


def _shape_distances(sh: Shape, grid, voxel_size) -> tuple[np.ndarray, np.ndarray]:
    """(fully inside, distance from the centre or axis to the nearest point) of every voxel, shape (gz, gy, gx)."""
    (cx, hx), (cy, hy), (cz, hz) = _voxel_bounds(grid, voxel_size)
    if isinstance(sh, Sphere):
        fx, nx = _far_near(cx, hx, sh.center[0])
        fy, ny = _far_near(cy, hy, sh.center[1])
        fz, nz = _far_near(cz, hz, sh.center[2])
        far = np.sqrt(fz[:, None, None] ** 2 + fy[None, :, None] ** 2 + fx[None, None, :] ** 2)
        near = np.sqrt(nz[:, None, None] ** 2 + ny[None, :, None] ** 2 + nx[None, None, :] ** 2)
        return far <= sh.radius, near
    fx, nx = _far_near(cx, hx, sh.center[0])
    fy, ny = _far_near(cy, hy, sh.center[1])
    far2 = np.sqrt(fy[:, None] ** 2 + fx[None, :] ** 2)
    near2 = np.sqrt(ny[:, None] ** 2 + nx[None, :] ** 2)
    z_in = (cz - hz >= sh.z0) & (cz + hz <= sh.z1)
    z_near = np.maximum(0.0, np.maximum(sh.z0 - cz - hz, cz - hz - sh.z1))
    inside = z_in[:, None, None] & (far2 <= sh.radius)[None, :, :]
    near = np.sqrt(z_near[:, None, None] ** 2 + near2[None, :, :] ** 2)
    return inside, near


def region_masks(phantom: Phantom, grid: Sequence[int], voxel_size: Sequence[float]) -> RegionMasks:
    """Masks of the phantom's inserts and background, for :func:`mlemlib.metrics.contrast_recovery`.

    An insert's mask holds the voxels lying entirely inside it (or, for an
    insert smaller than a voxel, the voxel holding its centre); regions
    sharing a label (the rods of one Derenzo sector) share one mask. The
    background holds the voxels entirely inside the body and farther than one
    voxel from every insert. Masks are boolean, shape ``(gridZ, gridY, gridX)``.
    """
    g, vs = _check_grid(grid, voxel_size)
    margin = max(vs)
    body_in, _ = _shape_distances(phantom.body, g, vs)
    background = body_in.copy()
    masks: dict[str, np.ndarray] = {}
    activity: dict[str, float] = {}
    for sh in phantom.shapes[1:]:
        inside, near = _shape_distances(sh, g, vs)
        if not inside.any():
            inside = np.zeros_like(inside)
            (cx, _), (cy, _), (cz, _) = _voxel_bounds(g, vs)
            px, py = sh.center[0], sh.center[1]
            pz = sh.center[2] if isinstance(sh, Sphere) else 0.5 * (sh.z0 + sh.z1)
            idx = (int(np.argmin(np.abs(cz - pz))), int(np.argmin(np.abs(cy - py))), int(np.argmin(np.abs(cx - px))))
            inside[idx] = True
        label = sh.label or f"region{len(masks) + 1}"
        masks[label] = masks[label] | inside if label in masks else inside
        activity[label] = float(sh.value)
        background &= near > sh.radius + margin
    return RegionMasks(masks, background, activity, float(phantom.body.value))


# --------------------------------------------------------------------------- matrix helpers
def _open_source(matrix: Any):
    """An object with ``shape``/``iter_chunks``: opened from a path, or a CSRMatrix wrapped."""
    from mlemlib.formats import open_source

    return open_source(matrix, "matrix")


def forward_project(matrix: Any, f: np.ndarray, *, max_nnz: int = 1 << 24) -> np.ndarray:
    """``A @ f`` in float64, streaming the matrix in row blocks of at most ``max_nnz`` elements.

    Parameters
    ----------
    matrix
        A path, an opened matrix (``mlemlib.formats.open_matrix``) or a :class:`~mlemlib.matrix.CSRMatrix`.
    f
        Image of ``n`` values (any shape; flattened in C order).

    Returns
    -------
    numpy.ndarray
        float64, length m.
    """
    from mlemlib.backends.cpu import passive_omp_wait, spmv

    passive_omp_wait()
    src = _open_source(matrix)
    m, n = src.shape
    x = np.ascontiguousarray(np.asarray(f, dtype=np.float64).reshape(-1))
    if x.size != n:
        raise ConfigError("image", f"image has {x.size} voxels but the matrix has n = {n} columns")
    y = np.zeros(m, dtype=np.float64)
    for r0, r1, block in src.iter_chunks(max_nnz=max_nnz):
        spmv(block.indptr, block.indices, block.data, x, y[r0:r1])
        log.debug("forward projection: rows %d..%d of %d", r0, r1, m)
    return y


# --------------------------------------------------------------------------- simulation
def simulate(
    matrix: Any,
    phantom: str | np.ndarray,
    out_sino: str | os.PathLike,
    out_truth: str | os.PathLike | None = None,
    *,
    seed: int = 1,
    noiseless: bool = False,
    counts: float | None = None,
    supersample: int = 3,
    max_nnz: int = 1 << 24,
) -> dict[str, Any]:
    """Simulate a measurement ``g`` of a phantom and write ``.LMsino`` (+ ``truth.h5``).

    ``g ~ Poisson(s A f)`` with ``s = counts / sum(A f)``, drawn by
    ``numpy.random.default_rng(seed)``; ``noiseless`` writes ``rint(s A f)``.

    Parameters
    ----------
    matrix
        System matrix: a path (``.h5``, ``.csr4``, ...), an opened matrix or a CSRMatrix.
        It must know its grid and voxel size unless ``phantom`` is an array.
    phantom
        ``"nema"``, ``"derenzo"``, ``"uniform"`` or an image of n values.
    out_sino
        The ``.LMsino`` to write (int32 counts).
    out_truth
        ``truth.h5`` to write (the phantom times ``s``), or None.
    seed
        Seed of the Poisson draw (same seed, same bytes).
    noiseless
        Round the expectation instead of drawing.
    counts
        Total expected counts (default :data:`DEFAULT_COUNTS`).
    supersample
        Points per voxel and axis when rasterising a named phantom.
    max_nnz
        Row-block size (elements) for streaming the matrix.

    Returns
    -------
    dict
        ``m``, ``n``, ``counts`` (the sum of g), ``expected_counts``, ``scale``,
        ``max_count``, ``seed``, ``noiseless``, ``phantom``, output paths.

    Raises
    ------
    ConfigError
        Unknown phantom, bad counts, counts that overflow int32.
    MatrixFormatError
        A named phantom on a matrix without grid/voxel size, or a matrix that
        sees nothing of the phantom.
    """
    src = _open_source(matrix)
    try:
        return _simulate(src, matrix, phantom, out_sino, out_truth, seed=seed, noiseless=noiseless, counts=counts,
                         supersample=supersample, max_nnz=max_nnz)
    finally:
        if src is not matrix and callable(getattr(src, "close", None)):
            src.close()


def _simulate(src: Any, matrix: Any, phantom: str | np.ndarray, out_sino: Any, out_truth: Any, *, seed: int,
              noiseless: bool, counts: float | None, supersample: int, max_nnz: int) -> dict[str, Any]:
    """The body of :func:`simulate` on an opened matrix."""
    from mlemlib.formats import matrix_geometry
    from mlemlib.formats.lmsino import write_lmsino
    from mlemlib.image import write_image

    source = os.fspath(matrix) if isinstance(matrix, (str, os.PathLike)) else str(getattr(src, "source", "<matrix>"))
    m, n = src.shape
    total = DEFAULT_COUNTS if counts is None else counts
    if not (isinstance(total, (int, float, np.integer, np.floating)) and math.isfinite(total) and total > 0):
        raise ConfigError("counts", f"total counts must be a positive number, got {counts!r}")
    grid, vs = matrix_geometry(src)
    shapes_json = None
    if isinstance(phantom, str):
        if grid is None:
            raise MatrixFormatError(source, "has no voxel grid (grid/voxel_size attributes); cannot place a phantom")
        if int(np.prod(grid)) != n:
            raise MatrixFormatError(source, f"grid {grid} has {int(np.prod(grid))} voxels but the matrix has n = {n} columns")
        ph = phantom_shapes(phantom, grid, vs)
        shapes_json = ph.to_json()
        log.info("rasterising phantom %s on grid %s (voxel %s mm, %d^3 samples per voxel)", phantom, grid, vs, supersample)
        f = rasterize(ph.shapes, grid, vs, supersample=supersample)
        name = phantom
    else:
        f = np.asarray(phantom, dtype=np.float32)
        if f.size != n:
            raise ConfigError("phantom", f"image has {f.size} voxels but the matrix has n = {n} columns")
        if not np.isfinite(f).all() or (f < 0).any():
            raise ConfigError("phantom", "image must be finite and non-negative")
        name = "custom"
    from mlemlib.fold import fold_of
    from mlemlib.reorder import image_to_permuted_order, measurement_to_user_order, permutation_of

    perm = permutation_of(src)
    row_fold = fold_of(src)
    log.info("forward projecting the phantom through %s (%d x %d)", source, m, n)
    if perm is None:
        expected = forward_project(src, f, max_nnz=max_nnz)
    else:
        # A reordered matrix: project the phantom in its permuted voxel order and
        # bring the LORs back to the user's order (f, the truth, stays in the user's).
        log.info("%s is reordered (%s): the measurement is written in the user's LOR order", source, perm.mode)
        f_perm = image_to_permuted_order(np.ascontiguousarray(f).reshape(-1), perm)
        expected = measurement_to_user_order(forward_project(src, f_perm, max_nnz=max_nnz), perm)
    if row_fold is not None:
        # A folded matrix: every LOR of a stored row sees the same expected counts (drawn independently).
        log.info("%s is folded: the measurement is written for all %d LORs", source, row_fold.m_user)
        expected = row_fold.unfold(expected)
        m = row_fold.m_user
    esum = float(expected.sum())
    if not esum > 0:
        raise MatrixFormatError(source, "the phantom's forward projection is zero everywhere (does the matrix see the grid?)")
    scale = float(total) / esum
    lam = expected * scale
    if noiseless:
        g = np.rint(lam)
    else:
        rng = np.random.default_rng(seed)
        g = rng.poisson(lam).astype(np.float64)
    imax = np.iinfo(np.int32).max
    if g.size and g.max() > imax:
        raise ConfigError("counts", f"{total:g} total counts give {g.max():.0f} counts in one LOR, over int32's {imax}")
    g32 = g.astype(np.int32)
    write_lmsino(out_sino, g32)
    truth = (f.astype(np.float64) * scale).astype(np.float32)
    if out_truth is not None:
        attrs = {
            "phantom": name,
            "scale": scale,
            "expected_counts": float(total),
            "seed": int(seed),
            "noiseless": bool(noiseless),
            "supersample": int(supersample),
            "matrix": source,
            "sino": os.fspath(out_sino),
        }
        if shapes_json is not None:
            attrs["regions"] = shapes_json
        write_image(out_truth, truth, grid=grid, voxel_size=vs, attrs=attrs)
    result = {
        "m": m,
        "n": n,
        "phantom": name,
        "counts": int(g32.sum(dtype=np.int64)),
        "expected_counts": float(total),
        "scale": scale,
        "max_count": int(g32.max()) if g32.size else 0,
        "seed": int(seed),
        "noiseless": bool(noiseless),
        "sino": os.fspath(out_sino),
        "truth": os.fspath(out_truth) if out_truth is not None else None,
    }
    log.info("simulated %s: %d counts in %d LORs (max %d per LOR)", name, result["counts"], m, result["max_count"])
    return result


def load_regions(truth_attrs: dict[str, Any], grid: Sequence[int] | None, voxel_size: Sequence[float] | None) -> RegionMasks | None:
    """Region masks from a ``truth.h5``'s attributes (None when it has no regions or no grid)."""
    text = truth_attrs.get("regions")
    if not text or grid is None or voxel_size is None:
        return None
    if isinstance(text, bytes):
        text = text.decode()
    ph = Phantom.from_json(text)
    if ph.body.value <= 0:
        return None  # a cold body (Derenzo) has no contrast to recover
    return region_masks(ph, grid, voxel_size)


__all__ = [
    "COLUMN_ORDER",
    "DEFAULT_COUNTS",
    "PHANTOMS",
    "Cylinder",
    "Phantom",
    "RegionMasks",
    "Sphere",
    "forward_project",
    "load_regions",
    "make_phantom",
    "phantom_shapes",
    "rasterize",
    "region_masks",
    "simulate",
]
