"""One-off probe: OSEM S=8 on madpet2 (noiseless NEMA) with the angle subsets visited in bit-reversed order
(0,4,2,6,1,5,3,7: each next subset far in angle from the last) instead of 0..7."""
import sys
import numpy as np
import mlemlib.subsets as SB

orig = SB.angle_labels
perm = np.array([0, 4, 2, 6, 1, 5, 3, 7], dtype=np.int32)  # bit reversal: its own inverse


def spread(cfg, subsets, **kw):
    lab = orig(cfg, subsets, **kw)
    return perm[lab] if subsets == 8 else lab


SB.angle_labels = spread
from mlemlib.cli import run  # noqa: E402

sys.argv = ["mlem"] + sys.argv[1:]
run()
