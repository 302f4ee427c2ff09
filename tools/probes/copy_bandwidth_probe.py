"""Probe (not kept): where a run's copy-bandwidth measurement waits 2-5 s when three GPU jobs reach it together."""
import multiprocessing as mp
import sys
import time


def job(k, start_at, q):
    import numpy as np
    import cupy as cp
    import cupyx
    while time.time() < start_at:
        time.sleep(0.001)
    T = {}
    t = time.perf_counter()
    cp.cuda.Device(k).use()
    a = cp.empty(30 * 10**9, dtype=cp.uint8)
    T["ctx+alloc"] = time.perf_counter() - t
    t = time.perf_counter()
    bufs = [cupyx.empty_pinned(320 << 20, dtype=np.uint8) for _ in range(2)]
    s = cp.cuda.Stream(non_blocking=True)
    for i in range(60):
        a[i * (320 << 20):(i + 1) * (320 << 20)].set(bufs[i % 2], stream=s)
    s.synchronize()
    del bufs
    cp.get_default_pinned_memory_pool().free_all_blocks()
    T["h2d 19GB"] = time.perf_counter() - t
    t = time.perf_counter(); src = cp.arange((256 << 20) // 4, dtype=cp.float32); cp.cuda.Device().synchronize(); T["arange"] = time.perf_counter() - t
    t = time.perf_counter(); dst = cp.empty_like(src); [cp.copyto(dst, src) for _ in range(3)]; cp.cuda.Device().synchronize(); T["copyto"] = time.perf_counter() - t
    t = time.perf_counter(); ok = bool(cp.array_equal(dst[-1024:], src[-1024:])); T["array_equal"] = time.perf_counter() - t
    t = time.perf_counter(); del src, dst; cp.get_default_memory_pool().free_all_blocks(); T["free_all_blocks"] = time.perf_counter() - t
    t = time.perf_counter(); from mlemlib.devices import copy_bandwidth; copy_bandwidth(256 << 20, repeat=5, device=k); T["copy_bandwidth again"] = time.perf_counter() - t
    q.put((k, {x: round(v, 3) for x, v in T.items()}))


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    for n in (3, 1, 3):
        q = ctx.Queue()
        at = time.time() + 4
        ps = [ctx.Process(target=job, args=(k, at, q)) for k in range(n)]
        [p.start() for p in ps]
        [p.join() for p in ps]
        print(f"{n} at once:", sorted(q.get() for _ in range(n)), flush=True)
