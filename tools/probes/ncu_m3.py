"""Probe (not kept): L2 sectors and atomics per non-zero of the one pass on Matrix 3's first eighth of rows."""
import sys
import numpy as np
import cupy as cp
from mlemlib.backends import _compressed_cuda as cc
from mlemlib.formats import open_matrix

path = sys.argv[1]
with open_matrix(path) as src:
    m, n = src.shape
    a = cc.DeviceCompressed.upload(src, (0, m // 8))
print("rows", a.shape[0], "nnz", a.nnz, "slots", a.slots, flush=True)
f = cp.ones(n, dtype=cp.float32)
g = cp.ones(a.shape[0], dtype=cp.float32)
bp = cp.empty(n, dtype=cp.float32)
acc = cp.empty(n, dtype=cp.uint64)
for det in (False, True):
    for _ in range(2):
        cc.onepass(a, g, f, bp=bp, deterministic=det, acc=acc if det else None)
    cp.cuda.Device().synchronize()
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    e0.record()
    for _ in range(5):
        cc.onepass(a, g, f, bp=bp, deterministic=det, acc=acc if det else None)
    e1.record(); e1.synchronize()
    print("det" if det else "float", f"{cp.cuda.get_elapsed_time(e0, e1) / 5:.3f} ms per step", flush=True)
