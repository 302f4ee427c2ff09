"""Make the two benchmark matrices of docs/stages.md: a PET-like one (mlemlib.scanner) and a random one."""
import dataclasses, sys, time
import numpy as np
from mlemlib.matrix import CSRMatrix
from mlemlib.formats import convert
from mlemlib.formats.h5 import write_matrix_h5
from mlemlib.scanner import get_preset, generate

out = sys.argv[1]
c = get_preset("madpet2")
cfg = dataclasses.replace(c, name="bench", layers=c.layers[:1], n_rings=4, ring_gaps=(0.3,) * 3,
                          grid=(140, 140, 20), voxel_size=(0.5, 0.5, 0.43), rays=16).validate("bench")
t = time.time(); generate(cfg, f"{out}/pet.csr4"); convert(f"{out}/pet.csr4", f"{out}/pet.h5"); print("pet", time.time() - t)
m, n, per_row = 82944, 392000, 490
rng = np.random.default_rng(1)
counts = rng.poisson(per_row, m)
rows = np.repeat(np.arange(m, dtype=np.int64), counts)
keys = np.unique(rows * n + rng.integers(0, n, rows.size))   # sorted, duplicate-free
del rows
r, cidx = np.divmod(keys, n); del keys
indptr = np.zeros(m + 1, np.int64); np.cumsum(np.bincount(r, minlength=m), out=indptr[1:])
a = CSRMatrix(indptr, cidx.astype(np.int32), rng.uniform(0.01, 1, cidx.size).astype(np.float32), (m, n))
write_matrix_h5(f"{out}/random.h5", a, source="random")
print("random", a.nnz)
