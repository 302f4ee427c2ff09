"""Scanner presets: ``small`` (CI and the default workflow) and ``madpet2`` (thesis Matrix 2 sizes).

``madpet2`` follows the MADPET-II small-animal scanner (McElroy et al. 2005):
18 blocks, each two radial layers of 4 (tangential) x 8 (axial) LSO crystals
of 2 x 2 mm face (6 mm deep in front, 8 mm behind), 2.3 mm pitch, front
layer at 71 mm from the axis: 2 x 8 x 18 x 4 = 1152 crystals, so
1152**2 = 1,327,104 lines of response, and a 140 x 140 x 40 voxel grid
(784,000 columns), the dimensions of the thesis's Matrix 2. The grid's voxels
are 0.5 x 0.5 x 0.4 mm: 70 x 70 mm across (inside the 71 mm ring) and 16 mm
long, inside the 18.1 mm axial extent of the rings, so every voxel is crossed
by many tubes.
"""

from __future__ import annotations

from mlemlib.errors import ConfigError
from mlemlib.scanner.geometry import Layer, ScannerConfig

#: LSO at 511 keV, 1/mm (recorded in the scanner block only).
MU_LSO = 0.087

SMALL = ScannerConfig(
    name="small",
    layers=(Layer(width=2.0, height=2.0, depth=6.0, radius=30.0, mu=MU_LSO),),
    n_blocks=12,
    block_size=4,
    block_gaps=(0.3, 0.3, 0.3),
    n_rings=4,
    ring_gaps=(0.3, 0.3, 0.3),
    voxel_size=(1.0, 1.0, 1.0),
    grid=(20, 20, 8),
    rays=16,
).validate("preset small")

MADPET2 = ScannerConfig(
    name="madpet2",
    layers=(
        Layer(width=2.0, height=2.0, depth=6.0, radius=71.0, mu=MU_LSO),
        Layer(width=2.0, height=2.0, depth=8.0, radius=78.0, mu=MU_LSO),
    ),
    n_blocks=18,
    block_size=4,
    block_gaps=(0.3, 0.3, 0.3),
    n_rings=8,
    ring_gaps=(0.3,) * 7,
    voxel_size=(0.5, 0.5, 0.4),
    grid=(140, 140, 40),
    rays=81,
).validate("preset madpet2")

#: Presets by name.
PRESETS: dict[str, ScannerConfig] = {"small": SMALL, "madpet2": MADPET2}


def get_preset(name: str, *, rays: int | None = None) -> ScannerConfig:
    """Return preset ``name``, optionally with another ray count per tube.

    Raises
    ------
    ConfigError
        For an unknown name or an invalid ray count.
    """
    try:
        cfg = PRESETS[name]
    except KeyError:
        raise ConfigError("preset", f"unknown preset {name!r}, expected one of {', '.join(PRESETS)}") from None
    if rays is not None:
        cfg = cfg.with_rays(rays)
    return cfg
