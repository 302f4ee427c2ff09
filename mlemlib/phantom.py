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

Realistic data (:class:`ScannerEffects`, all off by default): per-LOR
multiplicative factors ``m`` (attenuation ``exp(-sum_j A_ij mu_j)`` of the
phantom's water-equivalent mu-map, :func:`attenuation_map`, in 1/mm against
the matrix's chord lengths in mm; crystal-efficiency normalisation,
:func:`normalisation_factors`) and an additive background ``b`` (uniform
randoms, smooth scatter, :func:`scatter_source`) at configured fractions of
the total counts; then ``g ~ Poisson(m * A f + b)``, and ``m`` and ``b`` are
written as raw float32 per LOR. The activity, the mu-map and the scatter
source are projected in the same pass over the matrix's row blocks
(:func:`project_images`).
"""

from __future__ import annotations

import dataclasses
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
    return project_images(matrix, [f], max_nnz=max_nnz)[0]


def project_images(
    matrix: Any, images: Sequence[np.ndarray], *, max_nnz: int = 1 << 24, row_filled: bool = False
) -> list[np.ndarray]:
    """``A @ x`` of every image in one pass over the matrix's row blocks (float64 accumulation).

    Each row block is read once and multiplied with every image, so that
    projecting the activity, the mu-map and the scatter source together
    costs one read of the matrix.

    Parameters
    ----------
    matrix
        A path, an opened matrix or a :class:`~mlemlib.matrix.CSRMatrix`.
    images
        Images of ``n`` values each (any shape; flattened in C order).
    max_nnz
        Row-block size (elements).
    row_filled
        Also return, last, 1.0 for every row that holds a non-zero and 0.0 for an empty one.

    Returns
    -------
    list of numpy.ndarray
        float64, length m each, in the order of ``images`` (then the filled rows).
    """
    from mlemlib.backends.cpu import passive_omp_wait, spmv

    passive_omp_wait()
    src = _open_source(matrix)
    m, n = src.shape
    xs = []
    for f in images:
        x = np.ascontiguousarray(np.asarray(f, dtype=np.float64).reshape(-1))
        if x.size != n:
            raise ConfigError("image", f"image has {x.size} voxels but the matrix has n = {n} columns")
        xs.append(x)
    ys = [np.zeros(m, dtype=np.float64) for _ in xs]
    filled = np.zeros(m, dtype=np.float64) if row_filled else None
    for r0, r1, block in src.iter_chunks(max_nnz=max_nnz, reuse=True):
        for x, y in zip(xs, ys):
            spmv(block.indptr, block.indices, block.data, x, y[r0:r1])
        if filled is not None:
            filled[r0:r1] = np.diff(block.indptr) > 0
        log.debug("forward projection: rows %d..%d of %d", r0, r1, m)
    return ys if filled is None else [*ys, filled]


# --------------------------------------------------------------------------- scanner effects
#: Linear attenuation coefficient of water at 511 keV, 1/mm.
MU_WATER = 0.0096

#: Lung tissue at 511 keV, 1/mm: water's mass attenuation at about 0.3 g/cm^3
#: (inflated lung; the NEMA phantom's lung insert is foam of that density).
MU_LUNG = 0.0029

#: Unit of mu-maps and of the line integrals ``sum_j A_ij mu_j`` (the matrix's values are mm).
MU_UNITS = "1/mm"


@dataclass(frozen=True)
class ScannerEffects:
    """What a simulated measurement sees of a real scanner, besides the activity.

    Defaults are all off: :func:`simulate` then draws ``Poisson(A f)`` as it
    always did, byte for byte.

    Parameters
    ----------
    attenuation
        Attenuate each LOR by ``exp(-sum_j A_ij mu_j)``: the phantom's
        water-equivalent mu-map (:func:`attenuation_map`) integrated along the
        LOR through ``A`` itself, whose values are chord lengths in mm.
    normalisation_spread
        Coefficient of variation of the crystal efficiencies (lognormal, mean
        1); each LOR gets the product of its two crystals' (or, for a matrix
        without a known scanner geometry, one factor of its own with this
        spread). 0 for none.
    normalisation_seed
        Seed of the efficiencies (a property of the scanner: every noise seed
        of a measurement shares them).
    randoms_fraction
        Expected randoms as a fraction of the expected total counts, spread
        uniformly over the LORs whose row is not empty.
    scatter_fraction
        Expected scatter as a fraction of the expected total counts: the
        forward projection of the activity blurred by a 3-D Gaussian of
        ``scatter_sigma`` mm (smooth across LORs, with tails beyond the body).
    scatter_sigma
        Standard deviation of that Gaussian in mm; None for a quarter of the
        field of view's transaxial width.
    """

    attenuation: bool = False
    normalisation_spread: float = 0.0
    normalisation_seed: int = 0
    randoms_fraction: float = 0.0
    scatter_fraction: float = 0.0
    scatter_sigma: float | None = None

    def check(self) -> ScannerEffects:
        """Validate the values; return self.

        Raises
        ------
        ConfigError
            Naming the key: a spread or fraction that is negative or not a
            number, fractions that leave no true counts, a bad seed or sigma.
        """
        if not isinstance(self.attenuation, (bool, np.bool_)):
            raise ConfigError("attenuation", f"must be true or false, got {self.attenuation!r}")
        for key in ("normalisation_spread", "randoms_fraction", "scatter_fraction"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v) or v < 0:
                raise ConfigError(key, f"must be a number >= 0, got {v!r}")
        if self.randoms_fraction + self.scatter_fraction >= 1:
            raise ConfigError(
                "randoms_fraction",
                f"randoms_fraction + scatter_fraction = {self.randoms_fraction + self.scatter_fraction:g} "
                "leaves no true counts; their sum must be below 1",
            )
        seed = self.normalisation_seed
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ConfigError("normalisation_seed", f"must be an integer >= 0, got {seed!r}")
        sigma = self.scatter_sigma
        if sigma is not None and (
            isinstance(sigma, bool) or not isinstance(sigma, (int, float, np.integer, np.floating))
            or not math.isfinite(sigma) or sigma <= 0
        ):
            raise ConfigError("scatter_sigma", f"must be a positive number of mm or None, got {sigma!r}")
        return self

    @property
    def multiplicative(self) -> bool:
        """True when some per-LOR factor differs from 1 (attenuation or normalisation)."""
        return bool(self.attenuation) or self.normalisation_spread > 0

    @property
    def additive(self) -> bool:
        """True when there is an additive background (randoms or scatter)."""
        return self.randoms_fraction > 0 or self.scatter_fraction > 0

    @property
    def any(self) -> bool:
        """True when anything is simulated beyond ``Poisson(A f)``."""
        return self.multiplicative or self.additive


def attenuation_map(phantom: Phantom, grid: Sequence[int], voxel_size: Sequence[float], *, supersample: int = 3) -> np.ndarray:
    """The water-equivalent mu-map of a phantom, in 1/mm (:data:`MU_UNITS`).

    Every shape is water (:data:`MU_WATER`; a cold insert or the cold body of
    ``derenzo`` holds water without activity) except those labelled ``lung``
    (:data:`MU_LUNG`); outside the body, air (0). Painted and antialiased as
    :func:`rasterize` paints the activity.

    Returns
    -------
    numpy.ndarray
        float32, shape ``(gridZ, gridY, gridX)``.
    """
    shapes = [dataclasses.replace(sh, value=MU_LUNG if sh.label == "lung" else MU_WATER) for sh in phantom.shapes]
    return rasterize(shapes, grid, voxel_size, supersample=supersample)


def crystal_efficiencies(n_crystals: int, spread: float, seed: int) -> np.ndarray:
    """Detector efficiencies: lognormal with mean 1 and coefficient of variation ``spread`` (float64)."""
    sigma2 = math.log1p(float(spread) ** 2)
    rng = np.random.default_rng(seed)
    return rng.lognormal(mean=-0.5 * sigma2, sigma=math.sqrt(sigma2), size=int(n_crystals))


def scanner_geometry(src: Any):
    """The scanner block of an opened matrix, parsed (:class:`~mlemlib.formats.csr4.ScannerGeometry`); None without one.

    A ``.csr4`` has it in its header; a container made from one (or by the
    generator) keeps it as its ``scanner_block`` attribute.
    """
    from mlemlib.formats.csr4 import ScannerGeometry

    geometry = getattr(getattr(src, "header", None), "geometry", None)
    if geometry is not None:
        return geometry
    block = getattr(src, "scanner_block", None)
    if block is None:
        block = (getattr(src, "attrs", None) or {}).get("scanner_block")
    if block is None:
        return None
    return ScannerGeometry.from_bytes(bytes(block), str(getattr(src, "source", "<matrix>")))


def lor_crystals(geometry: Any, m: int) -> int | None:
    """Crystals of the scanner whose LOR ``i * n_crystals + j`` is row ``i * n_crystals + j`` of an m-row matrix; None where m is not ``n_crystals**2``."""
    if geometry is None:
        return None
    n_crystals = len(geometry.layers) * geometry.n_rings * geometry.n_blocks * geometry.block_size
    return n_crystals if n_crystals * n_crystals == m else None


def normalisation_factors(m: int, spread: float, seed: int, n_crystals: int | None = None) -> np.ndarray:
    """Per-LOR normalisation (float64, length m) from detector efficiencies.

    With ``n_crystals`` (LOR ``i * n_crystals + j`` joins crystals i and j) the
    factor of a LOR is ``eps_i * eps_j`` (:func:`crystal_efficiencies`), and 0
    where ``i == j`` (a crystal with itself is no line of response); else each
    LOR draws a factor of its own with the same spread.
    """
    if n_crystals is None:
        return crystal_efficiencies(m, spread, seed)
    eps = crystal_efficiencies(n_crystals, spread, seed)
    factors = np.outer(eps, eps)
    np.fill_diagonal(factors, 0.0)
    return factors.reshape(-1)


def scatter_source(f: np.ndarray, grid: Sequence[int], voxel_size: Sequence[float], sigma: float | None) -> tuple[np.ndarray, float]:
    """The activity blurred by a 3-D Gaussian of ``sigma`` mm (zero outside the grid), and that sigma.

    ``sigma`` None takes a quarter of the field of view's transaxial width.
    """
    from scipy.ndimage import gaussian_filter

    (gx, gy, gz), (vx, vy, vz) = _check_grid(grid, voxel_size)
    if sigma is None:
        sigma = 0.25 * min(gx * vx, gy * vy)
    image = np.asarray(f, dtype=np.float64).reshape(gz, gy, gx)
    blurred = gaussian_filter(image, sigma=(sigma / vz, sigma / vy, sigma / vx), mode="constant", truncate=4.0)
    return blurred, float(sigma)


def _write_factors(path: str | os.PathLike, values: np.ndarray) -> None:
    """Write one float32 per LOR, raw little-endian, no header, atomically."""
    from mlemlib._io import atomic_path

    out = np.ascontiguousarray(values, dtype="<f4")
    with atomic_path(path) as tmp:
        out.tofile(tmp)


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
    effects: ScannerEffects | None = None,
    mu_map: np.ndarray | None = None,
    out_multiplicative: str | os.PathLike | None = None,
    out_additive: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Simulate a measurement ``g`` of a phantom and write ``.LMsino`` (+ ``truth.h5``, + ``m`` and ``b``).

    ``g ~ Poisson(m * s A f + b)``, drawn by ``numpy.random.default_rng(seed)``;
    ``noiseless`` writes ``rint(m * s A f + b)``. Without ``effects``, ``m = 1``
    and ``b = 0`` and ``s = counts / sum(A f)``: today's ``Poisson(s A f)``.
    With them, ``m`` is attenuation x normalisation, ``b`` randoms + scatter
    at their fractions of ``counts``, and ``s`` scales the trues ``m * A f`` to
    the rest (:class:`ScannerEffects`). The matrix is read once, in row blocks.

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
        Total expected counts, background included (default :data:`DEFAULT_COUNTS`).
    supersample
        Points per voxel and axis when rasterising a named phantom (and its mu-map).
    max_nnz
        Row-block size (elements) for streaming the matrix.
    effects
        Attenuation, normalisation, randoms and scatter; None for none.
    mu_map
        The mu-map (1/mm, n values) to attenuate with instead of the named
        phantom's (needed for an image phantom with ``effects.attenuation``).
    out_multiplicative, out_additive
        Where to write ``m`` and ``b``: raw little-endian float32, one value
        per LOR in the user's LOR order, no header; None to skip. Written
        whenever given (all 1, or all 0, where ``effects`` leaves them so).

    Returns
    -------
    dict
        ``m``, ``n``, ``counts`` (the sum of g), ``expected_counts``, ``scale``,
        ``max_count``, ``seed``, ``noiseless``, ``phantom``, output paths; with
        ``effects``, also ``effects`` (what was simulated and the expected
        trues, randoms and scatter).

    Raises
    ------
    ConfigError
        Unknown phantom, bad counts, counts that overflow int32, bad effects
        (naming the key), attenuation of an image phantom without a mu-map.
    MatrixFormatError
        A named phantom on a matrix without grid/voxel size, or a matrix that
        sees nothing of the phantom.
    """
    if effects is not None:
        effects.check()
    src = _open_source(matrix)
    try:
        return _simulate(src, matrix, phantom, out_sino, out_truth, seed=seed, noiseless=noiseless, counts=counts,
                         supersample=supersample, max_nnz=max_nnz, effects=effects, mu_map=mu_map,
                         out_multiplicative=out_multiplicative, out_additive=out_additive)
    finally:
        if src is not matrix and callable(getattr(src, "close", None)):
            src.close()


@dataclass
class _Projections:
    """The per-LOR vectors of a simulation, in the user's LOR order (float64)."""

    activity: np.ndarray
    line_integral: np.ndarray | None = None
    scatter: np.ndarray | None = None
    filled: np.ndarray | None = None


def _project_user_order(src: Any, source: str, images: dict[str, np.ndarray], *, filled: bool,
                        max_nnz: int) -> tuple[_Projections, int, Any]:
    """Project user-order images in one pass; return the projections in the user's LOR order, m_user and the
    matrix's fold (None unless folded)."""
    from mlemlib.fold import fold_of
    from mlemlib.reorder import image_to_permuted_order, measurement_to_user_order, permutation_of

    perm = permutation_of(src)
    row_fold = fold_of(src)
    names = list(images)
    flat = [np.ascontiguousarray(images[k]).reshape(-1) for k in names]
    if perm is not None:
        # A reordered matrix: project the images in its permuted voxel order and
        # bring the LORs back to the user's order (the images stay in the user's).
        log.info("%s is reordered (%s): the measurement is written in the user's LOR order", source, perm.mode)
        flat = [image_to_permuted_order(x, perm) for x in flat]
    ys = project_images(src, flat, max_nnz=max_nnz, row_filled=filled)
    if filled:
        names.append("filled")
    if perm is not None:
        ys = [measurement_to_user_order(y, perm) for y in ys]
    m = src.shape[0]
    if row_fold is not None:
        # A folded matrix: every LOR of a stored row sees the same expected counts (drawn independently).
        log.info("%s is folded: the measurement is written for all %d LORs", source, row_fold.m_user)
        ys = [row_fold.unfold(y) for y in ys]
        m = row_fold.m_user
    return _Projections(**dict(zip(names, ys))), m, row_fold


def _simulate(src: Any, matrix: Any, phantom: str | np.ndarray, out_sino: Any, out_truth: Any, *, seed: int,
              noiseless: bool, counts: float | None, supersample: int, max_nnz: int, effects: ScannerEffects | None,
              mu_map: np.ndarray | None, out_multiplicative: Any, out_additive: Any) -> dict[str, Any]:
    """The body of :func:`simulate` on an opened matrix."""
    from mlemlib.formats import matrix_geometry
    from mlemlib.formats.lmsino import write_lmsino
    from mlemlib.image import write_image

    source = os.fspath(matrix) if isinstance(matrix, (str, os.PathLike)) else str(getattr(src, "source", "<matrix>"))
    m, n = src.shape
    total = DEFAULT_COUNTS if counts is None else counts
    if not (isinstance(total, (int, float, np.integer, np.floating)) and math.isfinite(total) and total > 0):
        raise ConfigError("counts", f"total counts must be a positive number, got {counts!r}")
    effects = effects if effects is not None and effects.any else None
    grid, vs = matrix_geometry(src)
    shapes_json = None
    ph = None
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
    images = {"activity": f}
    scatter_sigma = None
    if effects is not None:
        if effects.attenuation:
            images["line_integral"] = _mu_image(mu_map, ph, grid, vs, n, supersample)
        if effects.scatter_fraction > 0:
            if grid is None or int(np.prod(grid)) != n:
                raise ConfigError("scatter_fraction", f"{source} has no voxel grid to blur the activity on")
            images["scatter"], scatter_sigma = scatter_source(f, grid, vs, effects.scatter_sigma)
    log.info("forward projecting the phantom through %s (%d x %d)", source, m, n)
    randoms = effects is not None and effects.randoms_fraction > 0
    proj, m, _ = _project_user_order(src, source, images, filled=randoms, max_nnz=max_nnz)
    expected = proj.activity
    esum = float(expected.sum())
    if not esum > 0:
        raise MatrixFormatError(source, "the phantom's forward projection is zero everywhere (does the matrix see the grid?)")
    mult = add = None
    simulated: dict[str, Any] = {}
    if effects is None:
        scale = float(total) / esum
        lam = expected * scale
    else:
        mult, add, scale, simulated = _scanner_effects(src, source, proj, m, float(total), effects)
        simulated["scatter_sigma_mm"] = scatter_sigma
        lam = expected * mult * scale + add if mult is not None else expected * scale + add
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
    if out_multiplicative is not None:
        _write_factors(out_multiplicative, mult if mult is not None else np.ones(m))
    if out_additive is not None:
        _write_factors(out_additive, add if add is not None else np.zeros(m))
    files = {"multiplicative": out_multiplicative, "additive": out_additive}
    files = {k: os.fspath(v) for k, v in files.items() if v is not None}
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
        if simulated:
            # what the measurement holds beyond Poisson(A f), as JSON (docs/reconstruction.md)
            attrs["scanner_effects"] = json.dumps({**simulated, **files})
        elif files:
            attrs.update(files)
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
    if simulated:
        result["effects"] = simulated
    result.update(files)
    log.info("simulated %s: %d counts in %d LORs (max %d per LOR)", name, result["counts"], m, result["max_count"])
    return result


def _mu_image(mu_map: np.ndarray | None, ph: Phantom | None, grid: Any, vs: Any, n: int, supersample: int) -> np.ndarray:
    """The mu-map to attenuate with (1/mm): the caller's, else the named phantom's."""
    if mu_map is not None:
        mu = np.asarray(mu_map, dtype=np.float64).reshape(-1)
        if mu.size != n:
            raise ConfigError("mu_map", f"has {mu.size} voxels but the matrix has n = {n} columns")
        if not np.isfinite(mu).all() or (mu < 0).any():
            raise ConfigError("mu_map", f"must be finite and non-negative ({MU_UNITS})")
        return mu
    if ph is None:
        raise ConfigError("attenuation", "an image phantom has no mu-map: pass mu_map (1/mm), or use a named phantom")
    return attenuation_map(ph, grid, vs, supersample=supersample)


def _scanner_effects(src: Any, source: str, proj: _Projections, m: int, total: float,
                     effects: ScannerEffects) -> tuple[np.ndarray | None, np.ndarray, float, dict[str, Any]]:
    """``m`` (None for all 1), ``b``, the trues' scale and the record of what was simulated."""
    record: dict[str, Any] = {
        "attenuation": bool(effects.attenuation),
        "mu_units": MU_UNITS,
        "matrix_units": "mm (chord lengths)",
        "mu_water": MU_WATER,
        "mu_lung": MU_LUNG,
        "normalisation_spread": float(effects.normalisation_spread),
        "normalisation_seed": int(effects.normalisation_seed),
        "randoms_fraction": float(effects.randoms_fraction),
        "scatter_fraction": float(effects.scatter_fraction),
    }
    mult = None
    if effects.attenuation:
        mult = np.exp(-proj.line_integral)
        record["attenuation_min"] = float(mult.min()) if m else 1.0
    if effects.normalisation_spread > 0:
        n_crystals = lor_crystals(scanner_geometry(src), m)
        if n_crystals is None:
            log.info("%s: no scanner geometry with %d LORs: one normalisation factor per LOR", source, m)
        norm = normalisation_factors(m, effects.normalisation_spread, effects.normalisation_seed, n_crystals)
        record["normalisation"] = "crystal pairs" if n_crystals is not None else "per LOR"
        record["crystals"] = n_crystals
        mult = norm if mult is None else mult * norm
    if mult is not None:
        mult = mult.astype(np.float32).astype(np.float64)  # as the file holds it (see b below)
    trues = proj.activity * mult if mult is not None else proj.activity
    tsum = float(trues.sum())
    if not tsum > 0:
        raise MatrixFormatError(source, "the phantom's attenuated, normalised projection is zero everywhere")
    rest = 1.0 - effects.randoms_fraction - effects.scatter_fraction
    scale = rest * total / tsum
    add = np.zeros(m, dtype=np.float64)
    if effects.randoms_fraction > 0:
        lors = float(proj.filled.sum())
        if not lors > 0:
            raise MatrixFormatError(source, "has no non-empty row to spread randoms over")
        add += proj.filled * (effects.randoms_fraction * total / lors)
    if effects.scatter_fraction > 0:
        ssum = float(proj.scatter.sum())
        if not ssum > 0:
            raise MatrixFormatError(source, "the blurred activity's projection is zero everywhere: no scatter to spread")
        add += proj.scatter * (effects.scatter_fraction * total / ssum)
    # the expectation is made of the float32 values the files hold, so that the reconstruction's model is exact
    add = add.astype(np.float32).astype(np.float64)
    record.update(
        expected_trues=rest * total,
        expected_randoms=effects.randoms_fraction * total,
        expected_scatter=effects.scatter_fraction * total,
    )
    return mult, add, scale, record


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
    "MU_LUNG",
    "MU_UNITS",
    "MU_WATER",
    "Cylinder",
    "Phantom",
    "RegionMasks",
    "ScannerEffects",
    "Sphere",
    "attenuation_map",
    "crystal_efficiencies",
    "forward_project",
    "load_regions",
    "lor_crystals",
    "make_phantom",
    "normalisation_factors",
    "phantom_shapes",
    "project_images",
    "rasterize",
    "region_masks",
    "scanner_geometry",
    "scatter_source",
    "simulate",
]
