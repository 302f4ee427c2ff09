"""Probe (not kept): the compressed upload of Matrix 3, one GPU and four shards at once, by piece size and read threads."""
import sys, time, threading
import numpy as np
import cupy as cp
from mlemlib.backends import _compressed_cuda as cc
from mlemlib.formats import _direct as D
from mlemlib.formats import open_matrix

path = sys.argv[1]
res = []
for piece in (1 << 26, 1 << 24):
    for threads in (16, 32):
        cc.UPLOAD_CHUNK_NNZ = piece
        D.THREADS = threads
        D._pool = None
        for shards in (1, 4):
            with open_matrix(path) as src:
                m = src.shape[0]
                sp = src.read_slotptr()
                cuts = [int(np.searchsorted(sp, sp[-1] * k / shards)) for k in range(shards + 1)]
                cuts[0], cuts[-1] = 0, m
                out = [None] * shards
                def up(k):
                    with cp.cuda.Device(k):
                        out[k] = cc.DeviceCompressed.upload(src, (cuts[k], cuts[k + 1]), device=k)
                        cp.cuda.Device(k).synchronize()
                t = time.perf_counter()
                ths = [threading.Thread(target=up, args=(k,)) for k in range(shards)]
                [x.start() for x in ths]; [x.join() for x in ths]
                dt = time.perf_counter() - t
                nnz = sum(o.nnz for o in out)
                assert nnz == src.nnz, (nnz, src.nnz)
                del out
                for k in range(shards):
                    with cp.cuda.Device(k):
                        cp.get_default_memory_pool().free_all_blocks()
            line = f"piece 2^{piece.bit_length()-1} threads {threads} shards {shards}: {dt:.2f} s ({src.nbytes/dt/1e9:.1f} GB/s)"
            print(line, flush=True)
