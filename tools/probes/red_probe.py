"""Probe (not kept): the deterministic one pass with its 64-bit adds as RED (no returned value, no wrap check)
against ATOM (today's), on Matrix 3's first eighth of rows: time per step and the accumulator's bits."""
import hashlib, sys
import numpy as np
import cupy as cp
from mlemlib.backends import _compressed_cuda as cc
from mlemlib.formats import open_matrix

path = sys.argv[1]
with open_matrix(path) as src:
    m, n = src.shape
    a = cc.DeviceCompressed.upload(src, (0, m // 8))
rng = np.random.default_rng(1)
f = cp.asarray(rng.uniform(0.5, 2.0, n).astype(np.float32))
g = cp.asarray(rng.poisson(3.0, a.shape[0]).astype(np.float32))
bp = cp.empty(n, dtype=cp.float32)
acc = cp.empty(n, dtype=cp.uint64)
for det in (False, True):
    for _ in range(2):
        cc.onepass(a, g, f, bp=bp, deterministic=det, acc=acc if det else None)
    cp.cuda.Device().synchronize()
    ts = []
    for _ in range(9):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        cc.onepass(a, g, f, bp=bp, deterministic=det, acc=acc if det else None)
        e1.record(); e1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(e0, e1))
    h = hashlib.sha256(bp.get().tobytes()).hexdigest()[:16]
    print(sys.argv[2], "det" if det else "float", f"median {np.median(ts):.3f} ms", "bp", h if det else "-", flush=True)
