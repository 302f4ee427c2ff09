"""Synthetic PET scanner geometry: crystal layers, blocks, rings and a voxel grid (NumPy, host).

A scanner is a cylinder of flat detector blocks around the ``z`` axis, like
MADPET-II: ``n_blocks`` blocks evenly spaced in angle, each holding
``block_size`` crystals side by side (tangentially, with gaps), repeated over
``n_rings`` rings along ``z`` (with gaps) and over one or more radial
``layers``. The voxel grid is an axis-aligned box centred on the origin.

Conventions (also in ``docs/scanner.md``):

- Crystal number ``c = ((layer * n_rings + ring) * n_blocks + block) * block_size + k``
  (``k``: position inside the block, counter-clockwise), so consecutive
  crystals sweep a ring's angle.
- Line of response (row) ``i * n_crystals + j`` for crystals ``i, j``: ``m = n_crystals**2``.
- Voxel (column) ``x + gridX * (y + gridY * z)``: ``x`` fastest; an image vector
  reshapes to ``(gridZ, gridY, gridX)`` in C order.
- A layer's ``radius`` is the distance from the axis to the plane of the
  block's front face (the face the rays start from).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from mlemlib.errors import ConfigError

#: Column (voxel) orders of a generated matrix: the grid's raster order (x fastest), or the voxels along
#: the reorder stage's 3-D Hilbert curve (``mlemlib.scanner.generate(voxel_order=)``).
VOXEL_ORDERS = ("raster", "hilbert")

#: Largest row and column counts a ``.csr4`` header can hold (uint32 fields).
_MAX_CSR4 = 2**32 - 1


@dataclass(frozen=True)
class Layer:
    """One radial layer of crystals.

    Parameters
    ----------
    width
        Crystal face size along the ring's tangent (mm).
    height
        Crystal face size along the axis ``z`` (mm).
    depth
        Radial crystal length (mm); recorded in the scanner block, not traced.
    radius
        Distance from the axis to the front face of the layer's blocks (mm).
    mu
        Linear attenuation coefficient (1/mm); recorded, not used by the tracer.
    """

    width: float
    height: float
    depth: float
    radius: float
    mu: float = 0.0


@dataclass(frozen=True)
class ScannerConfig:
    """Everything that decides a generated system matrix (and nothing else).

    Parameters
    ----------
    name
        Preset name (informational; not part of the matrix).
    layers
        Radial layers, innermost first.
    n_blocks, block_size, block_gaps
        Blocks per ring, crystals per block, and the ``block_size - 1`` gaps
        between neighbouring crystals of a block (mm).
    n_rings, ring_gaps
        Rings along ``z`` and the ``n_rings - 1`` gaps between them (mm).
    voxel_size
        Voxel edge lengths ``(w, h, d)`` along ``x, y, z`` (mm).
    grid
        Voxels ``(gridX, gridY, gridZ)``.
    rays
        Rays per tube of response: ``k**4`` for a ``k x k`` grid of points on
        each crystal face, every point of one face joined to every point of
        the other. ``1`` is the thin line between the face centres.
    """

    name: str
    layers: tuple[Layer, ...]
    n_blocks: int
    block_size: int
    block_gaps: tuple[float, ...]
    n_rings: int
    ring_gaps: tuple[float, ...]
    voxel_size: tuple[float, float, float]
    grid: tuple[int, int, int]
    rays: int = 1

    # ------------------------------------------------------------------ sizes
    @property
    def crystals_per_ring(self) -> int:
        """Crystals in one ring of one layer."""
        return self.n_blocks * self.block_size

    @property
    def n_crystals(self) -> int:
        """All crystals: layers x rings x blocks x crystals per block."""
        return len(self.layers) * self.n_rings * self.crystals_per_ring

    @property
    def n_lors(self) -> int:
        """Rows of the system matrix, ``n_crystals**2`` (detector-pair order)."""
        return self.n_crystals**2

    @property
    def n_voxels(self) -> int:
        """Columns of the system matrix, ``gridX * gridY * gridZ``."""
        gx, gy, gz = self.grid
        return gx * gy * gz

    @property
    def shape(self) -> tuple[int, int]:
        """``(m, n)`` of the system matrix."""
        return (self.n_lors, self.n_voxels)

    @property
    def face_points(self) -> int:
        """``k``: points per face edge (``rays == k**4``)."""
        return _fourth_root(self.rays)

    # ------------------------------------------------------------- validation
    def validate(self, source: str = "scanner") -> ScannerConfig:
        """Check the configuration; return it unchanged.

        Raises
        ------
        ConfigError
            Naming ``source`` and the offending field: non-positive sizes, gap
            lists of the wrong length, a ray count that is not a fourth power,
            blocks that overlap, a grid that does not fit inside the innermost
            layer, or a matrix too large for a ``.csr4`` header.
        """
        if not self.layers:
            raise ConfigError(source, "layers: at least one layer is needed")
        for k, layer in enumerate(self.layers):
            for field in ("width", "height", "depth", "radius"):
                v = getattr(layer, field)
                if not (math.isfinite(v) and v > 0):
                    raise ConfigError(source, f"layers[{k}].{field} = {v!r}, expected a positive number (mm)")
            if not (math.isfinite(layer.mu) and layer.mu >= 0):
                raise ConfigError(source, f"layers[{k}].mu = {layer.mu!r}, expected >= 0 (1/mm)")
        for field in ("n_blocks", "block_size", "n_rings", "rays"):
            v = getattr(self, field)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ConfigError(source, f"{field} = {v!r}, expected an integer >= 1")
        if len(self.block_gaps) != self.block_size - 1:
            raise ConfigError(
                source,
                f"block_gaps has {len(self.block_gaps)} entries, expected block_size - 1 = {self.block_size - 1}",
            )
        if len(self.ring_gaps) != self.n_rings - 1:
            raise ConfigError(
                source, f"ring_gaps has {len(self.ring_gaps)} entries, expected n_rings - 1 = {self.n_rings - 1}"
            )
        for field in ("block_gaps", "ring_gaps"):
            for k, v in enumerate(getattr(self, field)):
                if not (math.isfinite(v) and v >= 0):
                    raise ConfigError(source, f"{field}[{k}] = {v!r}, expected a gap >= 0 (mm)")
        if len(self.voxel_size) != 3 or not all(math.isfinite(v) and v > 0 for v in self.voxel_size):
            raise ConfigError(source, f"voxel_size = {self.voxel_size!r}, expected three positive numbers (mm)")
        if len(self.grid) != 3 or not all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1 for v in self.grid
        ):
            raise ConfigError(source, f"grid = {self.grid!r}, expected three integers >= 1")
        if _fourth_root(self.rays) ** 4 != self.rays:
            ok = ", ".join(str(k**4) for k in range(1, 6))
            raise ConfigError(
                source,
                f"rays = {self.rays} is not a fourth power k**4 (k x k points on each crystal face, "
                f"every pair joined): use one of {ok}, ...",
            )
        if self.n_lors > _MAX_CSR4:
            raise ConfigError(source, f"{self.n_crystals} crystals give {self.n_lors} rows, more than a .csr4 holds")
        if self.n_voxels >= 2**31:
            raise ConfigError(source, f"grid {self.grid} has {self.n_voxels} voxels, more than int32 columns hold")
        # Blocks must not overlap: a flat block of half-width b at distance R
        # spans the angle 2*atan(b/R), at most 2*pi/n_blocks.
        for k, layer in enumerate(self.layers):
            half = 0.5 * block_span(self, layer)
            if self.n_blocks > 1 and math.atan2(half, layer.radius) > math.pi / self.n_blocks + 1e-12:
                raise ConfigError(
                    source,
                    f"layers[{k}]: blocks of {2 * half:g} mm at radius {layer.radius:g} mm overlap "
                    f"({self.n_blocks} blocks per ring); enlarge the radius or shrink the blocks",
                )
        r_min = min(layer.radius for layer in self.layers)
        gx, gy, _ = self.grid
        wx, wy, _ = self.voxel_size
        half_diag = 0.5 * math.hypot(gx * wx, gy * wy)
        if half_diag >= r_min:
            raise ConfigError(
                source,
                f"the voxel grid reaches {half_diag:g} mm from the axis, not inside the innermost "
                f"layer's radius {r_min:g} mm",
            )
        return self

    def with_rays(self, rays: int) -> ScannerConfig:
        """Return a validated copy with another ray count per tube."""
        return dataclasses.replace(self, rays=rays).validate("rays")

    # ----------------------------------------------------------- scanner block
    def to_geometry(self):
        """Return the :class:`mlemlib.formats.csr4.ScannerGeometry` of this scanner."""
        from mlemlib.formats.csr4 import ScannerGeometry

        return ScannerGeometry(
            layers=[
                (float(l.width), float(l.height), float(l.depth), float(l.radius), float(l.mu))
                for l in self.layers
            ],
            n_blocks=int(self.n_blocks),
            block_size=int(self.block_size),
            block_gaps=[float(g) for g in self.block_gaps],
            n_rings=int(self.n_rings),
            ring_gaps=[float(g) for g in self.ring_gaps],
            voxel_size=tuple(float(v) for v in self.voxel_size),
            grid=tuple(int(v) for v in self.grid),
        )

    def scanner_block(self) -> bytes:
        """The ``.csr4`` scanner-configuration block of this scanner."""
        return self.to_geometry().to_bytes()

    def describe(self) -> dict:
        """A JSON-friendly summary: sizes and every field."""
        d = dataclasses.asdict(self)
        d.update(
            n_crystals=self.n_crystals,
            shape=list(self.shape),
            face_points=self.face_points,
        )
        return d


def _fourth_root(n: int) -> int:
    """Integer ``k`` with ``k**4 <= n < (k+1)**4``."""
    k = max(1, round(n**0.25))
    while k**4 > n and k > 1:
        k -= 1
    while (k + 1) ** 4 <= n:
        k += 1
    return k


def _centred_positions(size: float, gaps: tuple[float, ...]) -> np.ndarray:
    """Centres of ``len(gaps)+1`` items of ``size`` separated by ``gaps``, centred on 0."""
    pos = np.empty(len(gaps) + 1, dtype=np.float64)
    pos[0] = 0.5 * size
    for k, g in enumerate(gaps):
        pos[k + 1] = pos[k] + size + float(g)
    total = pos[-1] + 0.5 * size
    return pos - 0.5 * total


def block_span(cfg: ScannerConfig, layer: Layer) -> float:
    """Tangential extent of one block of ``layer`` (mm)."""
    return cfg.block_size * layer.width + float(sum(cfg.block_gaps))


def box_bounds(cfg: ScannerConfig) -> tuple[np.ndarray, np.ndarray]:
    """Lower and upper corners of the voxel grid (mm), float64, centred on the origin."""
    ext = np.asarray(cfg.grid, dtype=np.float64) * np.asarray(cfg.voxel_size, dtype=np.float64)
    return -0.5 * ext, 0.5 * ext


def crystal_faces(cfg: ScannerConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Front-face geometry of every crystal, in crystal-number order.

    Returns
    -------
    centres : numpy.ndarray
        ``(n_crystals, 3)`` float64, centre of each front face (mm).
    tangents : numpy.ndarray
        ``(n_crystals, 3)`` float64, unit vector along the face's width
        (the ring's counter-clockwise tangent at the block).
    sizes : numpy.ndarray
        ``(n_crystals, 2)`` float64, face width and height (mm).
    """
    nb, bs, nr = cfg.n_blocks, cfg.block_size, cfg.n_rings
    ring_z = None
    centres = []
    tangents = []
    sizes = []
    for layer in cfg.layers:
        ring_z = _centred_positions(layer.height, cfg.ring_gaps)
        s = _centred_positions(layer.width, cfg.block_gaps)  # along the tangent
        phi = 2.0 * np.pi * np.arange(nb, dtype=np.float64) / nb
        u = np.stack([np.cos(phi), np.sin(phi)], axis=1)  # outward normal of block b
        t = np.stack([-np.sin(phi), np.cos(phi)], axis=1)  # counter-clockwise tangent
        # (ring, block, k) -> position
        xy = layer.radius * u[:, None, :] + s[None, :, None] * t[:, None, :]  # (nb, bs, 2)
        c = np.empty((nr, nb, bs, 3), dtype=np.float64)
        c[..., :2] = xy[None]
        c[..., 2] = ring_z[:, None, None]
        tt = np.zeros((nr, nb, bs, 3), dtype=np.float64)
        tt[..., :2] = t[None, :, None, :]
        centres.append(c.reshape(-1, 3))
        tangents.append(tt.reshape(-1, 3))
        sizes.append(np.broadcast_to([layer.width, layer.height], (nr * nb * bs, 2)))
    return np.concatenate(centres), np.concatenate(tangents), np.concatenate(sizes).astype(np.float64)


def face_points(cfg: ScannerConfig) -> np.ndarray:
    """Ray end points on every crystal face: ``(n_crystals, k*k, 3)`` float64 (mm).

    Point ``a * k + b`` of a face sits at tangential offset
    ``((a + 0.5) / k - 0.5) * width`` and axial offset
    ``((b + 0.5) / k - 0.5) * height`` from the face centre (the midpoint rule
    on a ``k x k`` grid; ``k = 1`` gives the centre).
    """
    k = cfg.face_points
    centres, tangents, sizes = crystal_faces(cfg)
    frac = (np.arange(k, dtype=np.float64) + 0.5) / k - 0.5
    ta = frac[:, None] * np.ones(k)[None, :]  # (k, k): a varies slowest
    ax = np.ones(k)[:, None] * frac[None, :]
    ta = ta.reshape(-1)
    ax = ax.reshape(-1)
    pts = (
        centres[:, None, :]
        + (ta[None, :] * sizes[:, 0:1])[:, :, None] * tangents[:, None, :]
        + (ax[None, :] * sizes[:, 1:2])[:, :, None] * np.array([0.0, 0.0, 1.0])[None, None, :]
    )
    return np.ascontiguousarray(pts)


def crystal_coords(cfg: ScannerConfig, c: int) -> tuple[int, int, int, int]:
    """``(layer, ring, block, k)`` of crystal number ``c``."""
    if not 0 <= c < cfg.n_crystals:
        raise ConfigError("crystal", f"crystal {c} outside [0, {cfg.n_crystals})")
    c, k = divmod(c, cfg.block_size)
    c, block = divmod(c, cfg.n_blocks)
    layer, ring = divmod(c, cfg.n_rings)
    return layer, ring, block, k


def lor_index(cfg: ScannerConfig, i: int, j: int) -> int:
    """Row number of the line of response between crystals ``i`` and ``j``."""
    return i * cfg.n_crystals + j


def voxel_index(cfg: ScannerConfig, x: int, y: int, z: int) -> int:
    """Column number of voxel ``(x, y, z)``: ``x + gridX * (y + gridY * z)``."""
    gx, gy, _ = cfg.grid
    return x + gx * (y + gy * z)
