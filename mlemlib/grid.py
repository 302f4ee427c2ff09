"""A matrix's voxel grid: checks of a grid given by the user (``mlem convert --grid``) or recorded in a file.

The grid is ``(nx, ny, nz)`` with voxel ``j = x + nx*(y + ny*z)`` (x fastest); no backend, no heavy imports
(:mod:`mlemlib.formats` records it, :mod:`mlemlib.prior` needs it).
"""

from __future__ import annotations

import math
import os
from typing import Any

from mlemlib.errors import ConfigError


def check_grid(grid: Any, n: int | None = None, key: str = "grid") -> tuple[int, int, int]:
    """``grid`` as three positive ints whose product is ``n`` (when given); one-line ConfigError naming ``key``."""
    try:
        g = tuple(int(v) for v in grid)
        ok = len(g) == 3 and all(v >= 1 for v in g) and all(float(v) == int(v) for v in grid)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(key, f"{grid!r}, expected three positive integers NX NY NZ")
    if n is not None and math.prod(g) != int(n):
        raise ConfigError(key, f"{g[0]}x{g[1]}x{g[2]} = {math.prod(g)} voxels, but the matrix has n = {int(n)} columns")
    return g  # type: ignore[return-value]



def given_geometry(
    source: str | os.PathLike,
    n: int,
    grid: Any,
    voxel_size: Any,
    found_grid: Any = None,
    found_voxel_size: Any = None,
) -> tuple[tuple[int, int, int] | None, tuple[float, float, float] | None]:
    """The grid and voxel size a converted matrix records: those given (``mlem convert --grid --voxel-size``)
    checked against its column count and against what the input already records, else the input's.

    Raises
    ------
    ConfigError
        One line naming ``source``: a grid whose product is not ``n``, not three positive integers, a voxel
        size that is not three positive numbers or is given without a grid, or a value that disagrees
        with the one the input records.
    """
    label = os.fspath(source)
    g = found_grid if grid is None else None
    if grid is not None:
        try:
            g = check_grid(grid, n, key=label)
        except ConfigError as exc:
            raise ConfigError(label, f"--grid {exc.fault}") from None
        if found_grid is not None and tuple(int(v) for v in found_grid) != g:
            raise ConfigError(label, f"records grid {'x'.join(str(int(v)) for v in found_grid)}, --grid gives "
                              f"{'x'.join(map(str, g))}")  # fmt: skip
    vs = found_voxel_size if voxel_size is None else None
    if voxel_size is not None:
        try:
            vs = tuple(float(v) for v in voxel_size)
            ok = len(vs) == 3 and all(math.isfinite(v) and v > 0 for v in vs)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ConfigError(label, f"--voxel-size {voxel_size!r}, expected three positive numbers (mm)")
        if g is None:
            raise ConfigError(label, "--voxel-size without a grid: give --grid NX NY NZ as well")
        if found_voxel_size is not None and tuple(float(v) for v in found_voxel_size) != vs:
            raise ConfigError(label, f"records voxel size {tuple(float(v) for v in found_voxel_size)}, --voxel-size "
                              f"gives {vs}")  # fmt: skip
    g = None if g is None else tuple(int(v) for v in g)
    vs = None if vs is None else tuple(float(v) for v in vs)
    return g, vs  # type: ignore[return-value]
