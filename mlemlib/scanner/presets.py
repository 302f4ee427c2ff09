"""Scanner presets: ``small`` (CI and the default workflow), ``madpet2`` and ``matrix3`` (thesis Matrices 2 and 3).

``madpet2`` follows the MADPET-II small-animal scanner (McElroy et al. 2005):
18 blocks, each two radial layers of 4 (tangential) x 8 (axial) LSO crystals
of 2 x 2 mm face (6 mm deep in front, 8 mm behind), 2.3 mm pitch, front
layer at 71 mm from the axis: 2 x 8 x 18 x 4 = 1152 crystals, so
1152**2 = 1,327,104 lines of response, and a 140 x 140 x 40 voxel grid
(784,000 columns), the dimensions of the thesis's Matrix 2. The grid's voxels
are 0.5 x 0.5 x 0.4 mm: 70 x 70 mm across (inside the 71 mm ring) and 16 mm
long, inside the 18.1 mm axial extent of the rings, so every voxel is crossed
by many tubes.

``matrix3`` has the dimensions of the thesis's Matrix 3 (Table 4.3, the
headline run of ch. 9.3.9): 2,304 crystals (MADPET-II's two layers of 18
blocks of 4, on 16 rings instead of 8), every pair a row: 2,304**2 =
5,308,416 lines of response, and a 180 x 180 x 80 grid (2,592,000 voxels)
of 0.5 x 0.5 x 0.4 mm (90 x 90 x 32 mm, inside the 71 mm ring and the
52.5 mm axial extent). Matrix 3 itself was artificial (12,312,716,683
non-zeros, no empty row); to come close to its non-zeros with a geometric
model, the tubes are wider than MADPET-II's: crystal faces of 4 mm
(tangential) x 3 mm (axial), 81 rays per tube. A 60,000-row sample
estimates 1.2366e10 non-zeros (+0.44% of Matrix 3's; mean row 2,330 against its 2,319; see
``docs/scanner.md``). :data:`NNZ` records the non-zeros of each preset:
exact where the whole matrix was generated, else the sampled estimate.
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

MATRIX3 = ScannerConfig(
    name="matrix3",
    layers=(
        Layer(width=4.0, height=3.0, depth=6.0, radius=71.0, mu=MU_LSO),
        Layer(width=4.0, height=3.0, depth=8.0, radius=78.0, mu=MU_LSO),
    ),
    n_blocks=18,
    block_size=4,
    block_gaps=(0.3, 0.3, 0.3),
    n_rings=16,
    ring_gaps=(0.3,) * 15,
    voxel_size=(0.5, 0.5, 0.4),
    grid=(180, 180, 80),
    rays=81,
).validate("preset matrix3")

#: Presets by name.
PRESETS: dict[str, ScannerConfig] = {"small": SMALL, "madpet2": MADPET2, "matrix3": MATRIX3}

#: Non-zeros of each preset with its own ray count: exact for ``small`` and
#: ``madpet2`` (generated whole), a 60,000-row sampled estimate for
#: ``matrix3`` (:func:`mlemlib.scanner.estimate`). The workflow sizes stages
#: from it before the matrix exists (:func:`mlemlib.cluster.generated_size`).
NNZ: dict[str, int] = {"small": 742_368, "madpet2": 960_942_960, "matrix3": 12_366_460_674}

#: Longest row of each preset (as :data:`NNZ`: exact, or the longest sampled row).
MAX_ROW_NNZ: dict[str, int] = {"small": 125, "madpet2": 3_890, "matrix3": 10_104}


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
