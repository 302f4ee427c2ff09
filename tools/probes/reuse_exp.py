"""CPU experiment (not kept): chunk reuse of OSEM angle subsets against the whole matrix, for views of several widths,
on a reduced madpet2 (2 rings, 140x140x8 grid, 16 rays)."""
import dataclasses, sys, time, os, json
import numpy as np
from mlemlib.scanner import presets
from mlemlib.scanner.system import generate
from mlemlib.reorder import reorder_file
from mlemlib.formats import open_matrix
from mlemlib import chunked, subsets as SB
from mlemlib.scanner.geometry import crystal_faces

cfg = dataclasses.replace(presets.MADPET2, n_rings=2, ring_gaps=(0.3,), grid=(140, 140, 8), rays=16)
src = "/tmp/rx/m.h5"
if not os.path.exists(src):
    t = time.time(); generate(cfg, src, fmt="csr", fold=True, rays=16); print("generated", time.time() - t, flush=True)
S = 16
SMS = 132
CAP = int(os.environ.get("CAP", "0"))


def labels_views(cfg, S, V):
    # as subsets.angle_labels, with V views instead of crystals_per_ring
    centres = crystal_faces(cfg)[0]
    nc = int(cfg.n_crystals); x, y = centres[:, 0], centres[:, 1]
    r = np.arange(nc * nc, dtype=np.int64)
    i, j = np.minimum(r // nc, r % nc), np.maximum(r // nc, r % nc)
    phi = np.mod(np.arctan2(y[j] - y[i], x[j] - x[i]), np.pi)
    pair = i * nc + j
    order = np.lexsort((pair, phi)); m = nc * nc
    pos = np.arange(m); first = np.ones(m, bool); first[1:] = pair[order][1:] != pair[order][:-1]
    start = np.maximum.accumulate(np.where(first, pos, 0))
    lab = np.empty(m, np.int32); lab[order] = (start * V // m) % S
    return lab


def reuse_of(path, bounds):
    with open_matrix(path) as f:
        a = f.to_csr()
    out = []
    for k in range(len(bounds) - 1):
        r0, r1 = int(bounds[k]), int(bounds[k + 1])
        ip = a.indptr[r0:r1 + 1]
        nnz = int(ip[-1] - ip[0])
        from mlemlib.matrix import slice_rows
        blk = slice_rows(a, r0, r1)
        p = chunked.build_plan(blk, chunk_cap=CAP or chunked.chunk_cap_for(nnz, SMS))
        out.append((nnz, int(p.vptr[-1]), len(p.vptr) - 1))
    nnz = sum(o[0] for o in out); vox = sum(o[1] for o in out); ch = sum(o[2] for o in out)
    return round(nnz / vox, 2), ch, nnz


res = {}
t = time.time()
reorder_file(src, "/tmp/rx/r1.h5", "rows+voxels")
with open_matrix("/tmp/rx/r1.h5") as f:
    m = f.shape[0]
res["S=1"] = reuse_of("/tmp/rx/r1.h5", [0, m])
print(res, time.time() - t, flush=True)
for V in [int(v) for v in sys.argv[1:]] or [cfg.crystals_per_ring, 48, 32, 16]:
    lab = labels_views(cfg, S, V)
    lab.astype("<i4").tofile("/tmp/rx/lab.i32")
    out = f"/tmp/rx/s{V}.h5"
    reorder_file(src, out, "rows+voxels", subsets=S, subset_file="/tmp/rx/lab.i32")
    import h5py
    with h5py.File(out, "r") as f:
        b = f["subset_bounds"][...]
    sizes = np.diff(b)
    res[f"S=16,V={V}"] = reuse_of(out, b) + (int(sizes.min()), int(sizes.max()))
    print(f"V={V}", res[f"S=16,V={V}"], flush=True)
json.dump(res, open("/tmp/rx/res.json", "w"))
