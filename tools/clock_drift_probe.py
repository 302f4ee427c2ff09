"""The fused madpet2 iteration block after block, beside the GPU's clocks, power and throttle reasons (NVML).

Issue 13: on the H200 the same iteration measured 3.79-3.93 ms on four
machines (91.7-95.4% of its floor), and blocks of 100 iterations in one
process differed by up to 7% (benchmarks.md sections 82 and 84). This probe
asks whether the GPU's state explains it. It runs the ``cuda`` backend's
``auto`` iteration (as ``mlem bench spmv`` times it) in ``--blocks`` blocks of
``--repeat`` iterations; before each block it can leave the GPU idle for
``--idle`` seconds (every other block), and after each it reads, through
NVML, the SM and memory clocks, the power, the temperature and the clock
event (throttle) reasons, and times a device copy (the floor's bandwidth).

Run from the repository root on the device:
``PYTHONPATH=. python3 tools/clock_drift_probe.py --out $OUT/drift.json``.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import device_kernels as dk  # noqa: E402

#: NVML clock event reasons (nvmlClocksEventReason*), by bit.
REASONS = {0x1: "gpu_idle", 0x2: "app_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal",
           0x40: "hw_thermal", 0x80: "hw_power_brake", 0x100: "display_clocks"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rays", type=int, default=81)
    ap.add_argument("--repeat", type=int, default=100)
    ap.add_argument("--blocks", type=int, default=24)
    ap.add_argument("--idle", type=float, default=2.0, help="seconds idle before every other block (0: none)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    import pynvml

    from mlemlib.backends import _cuda_plan as plan
    from mlemlib.backends.base import timed_iterations
    from mlemlib.backends.cuda import CudaBackend
    from mlemlib.bench import copy_bandwidth

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)

    def state():
        get = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
        r = int(get(h))
        return {"sm_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                "mem_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM),
                "power_w": pynvml.nvmlDeviceGetPowerUsage(h) / 1e3,
                "temp_c": pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
                "reasons": [v for k, v in REASONS.items() if r & k]}

    host, _ = dk.trace(args.rays)
    a, at = dk.build(host, "own")
    del host
    m, n = a.shape
    g, norm = dk.problem(a, at)
    floor_bytes = plan.iteration_floor_bytes(m, n, a.nnz)
    be = CudaBackend(a, g, norm, at, fp="auto", bp="auto", device=0)
    d = be.describe()
    print(f"{d['fp']} + {d['bp']}, layout {d.get('layout')}; {state()}", flush=True)
    f = be.initial_image()
    rows = []
    t_start = time.perf_counter()
    for b in range(args.blocks):
        idle = args.idle if (args.idle and b % 2 == 1) else 0.0
        if idle:
            time.sleep(idle)
        before = state()
        samples, stop = [], threading.Event()

        def sample():  # the SM clock and the power every 10 ms while the block runs
            while not stop.is_set():
                samples.append((pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                                pynvml.nvmlDeviceGetPowerUsage(h) / 1e3))
                time.sleep(0.01)

        th = threading.Thread(target=sample)
        th.start()
        t = []
        for _, f, ready in timed_iterations(be, f, 1, 3 + args.repeat):
            t += [times["iteration"] for k, times in ready if k > 3]
        stop.set()
        th.join()
        after = state()
        sm = np.array([s[0] for s in samples]) if samples else np.zeros(1)
        pw = np.array([s[1] for s in samples]) if samples else np.zeros(1)
        during = {"sm_mhz_min": int(sm.min()), "sm_mhz_median": float(np.median(sm)), "power_w_max": float(pw.max()),
                  "samples": len(samples)}
        bw = copy_bandwidth(1 << 30, repeat=10)["bandwidth"]
        med = float(np.median(t)) * 1e3
        row = {"block": b, "idle_s": idle, "t_s": round(time.perf_counter() - t_start, 2), "ms": med,
               "first10_ms": float(np.median(t[:10])) * 1e3, "last10_ms": float(np.median(t[-10:])) * 1e3,
               "copy_TBps": bw / 1e12, "of_floor": floor_bytes / bw / (med / 1e3), "before": before, "during": during, "after": after}
        rows.append(row)
        print(f"block {b:2d} idle {idle:.1f} s: {med:.4f} ms (first 10 {row['first10_ms']:.3f}, last 10 "
              f"{row['last10_ms']:.3f}), copy {bw / 1e12:.3f} TB/s, {100 * row['of_floor']:.1f}% of floor; "
              f"SM {before['sm_mhz']}->{during['sm_mhz_min']}/{during['sm_mhz_median']:.0f}->{after['sm_mhz']} MHz, mem {after['mem_mhz']} MHz, "
              f"{after['power_w']:.0f} W (max {during['power_w_max']:.0f}), {after['temp_c']} C, {after['reasons']}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"floor_bytes": floor_bytes, "blocks": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
