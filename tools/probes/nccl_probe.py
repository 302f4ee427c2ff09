"""One-off probe (not kept): the image exchange of one (sub-)iteration on P GPUs: all-reduce of 784,000 uint64
(what the fixed-point one pass does) against reduce-scatter of the uint64 + all-gather of float32 (each GPU
converts and updates a quarter), and a float32 all-reduce; 16 back to back (an OSEM pass), events, medians."""
import json, os, sys
import cupy as cp
import numpy as np
from cupy.cuda import nccl

out = sys.argv[1]
N = 784000
res = []
ngpu = cp.cuda.runtime.getDeviceCount()
for P in [p for p in (2, 4) if p <= ngpu]:
    devs = list(range(P))
    comms = nccl.NcclCommunicator.initAll(devs)
    bufs = []
    for d in devs:
        with cp.cuda.Device(d):
            s = cp.cuda.Stream(non_blocking=True)
            n = -(-N // P) * P
            bufs.append(dict(s=s, u=cp.ones(n, dtype=cp.uint64), f=cp.ones(n, dtype=cp.float32),
                             ur=cp.empty(n // P, dtype=cp.uint64), e0=cp.cuda.Event(), e1=cp.cuda.Event()))

    def op(kind):
        nccl.groupStart()
        for r, (c, b) in enumerate(zip(comms, bufs)):
            n = b["u"].size
            if kind == "ar_u64":
                c.allReduce(b["u"].data.ptr, b["u"].data.ptr, n, nccl.NCCL_UINT64, nccl.NCCL_SUM, b["s"].ptr)
            elif kind == "ar_f32":
                c.allReduce(b["f"].data.ptr, b["f"].data.ptr, n, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, b["s"].ptr)
            elif kind == "rs_u64":
                c.reduceScatter(b["u"].data.ptr, b["ur"].data.ptr, n // P, nccl.NCCL_UINT64, nccl.NCCL_SUM, b["s"].ptr)
            elif kind == "ag_f32":
                c.allGather(b["f"].data.ptr + r * (n // P) * 4, b["f"].data.ptr, n // P, nccl.NCCL_FLOAT32, b["s"].ptr)
        nccl.groupEnd()

    for kinds in (["ar_u64"], ["ar_f32"], ["rs_u64"], ["ag_f32"], ["rs_u64", "ag_f32"]):
        ts = []
        for rep in range(25):
            for b in bufs:
                with cp.cuda.Device(b["u"].device.id):
                    b["s"].synchronize()
            for d, b in zip(devs, bufs):
                with cp.cuda.Device(d):
                    b["e0"].record(b["s"])
            for _ in range(16):
                for k in kinds:
                    op(k)
            for d, b in zip(devs, bufs):
                with cp.cuda.Device(d):
                    b["e1"].record(b["s"])
            for d, b in zip(devs, bufs):
                with cp.cuda.Device(d):
                    b["e1"].synchronize()
            if rep >= 5:
                ts.append(max(cp.cuda.get_elapsed_time(b["e0"], b["e1"]) for b in bufs) / 16)
        row = {"P": P, "ops": "+".join(kinds), "us_each": round(1e3 * float(np.median(ts)), 2)}
        res.append(row)
        print(json.dumps(row), flush=True)
    for c in comms:
        c.destroy()
json.dump(res, open(os.path.join(out, "nccl_probe.json"), "w"), indent=1)
