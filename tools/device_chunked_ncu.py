#!/usr/bin/env python3
"""Nsight Compute profile of the chunked one pass (``onepass_chunked``) on ``madpet2`` in the reorder stage's order.

Run from the repository root on a GPU machine with ``ncu``::

    PYTHONPATH=. python3 tools/device_chunked_ncu.py --out $OUT [--rays 81] [--options STAGE=8,DYNAMIC=1] [--values u16]

Traces ``madpet2``, reorders it (``tools/device_kernels.py``'s
``own-reordered``), chunks it (:class:`mlemlib.backends._compressed_cuda.DeviceChunked`)
and profiles one ``chunked_onepass`` launch: speed of light, memory
(shared-memory bank conflicts included), occupancy, warp stalls (every
stall reason, cycles per issued instruction, pipe utilisation). ``--values f16`` /
``u16``: the matrix re-encoded as ``compressed-f16`` / ``compressed-u16`` first
(kernel ``chunked_onepass_f16`` / ``_u16``). ``--options``: the kernel
compiled with these ``MLEM_CHUNK_`` macros (as ``tools/device_onepass.py
--chunk-options``). Writes
``ncu_chunked.txt`` under ``--out`` and prints its main lines.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

TARGET = r'''
import sys
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/tools")
import cupy as cp
import device_kernels as dk
from mlemlib.backends import _compressed_cuda as gpu
host, _ = dk.trace(int(sys.argv[2]))
a, at = dk.build(host, "own-reordered")
del at
m, n = a.shape
f = cp.ones(n, dtype=cp.float32)
g = cp.ones(m, dtype=cp.float32)
gpu.OPTIONS = gpu.OPTIONS + tuple("-DMLEM_CHUNK_" + kv for kv in sys.argv[3].split(",") if kv)
if sys.argv[4] != "f32":
    from mlemlib.compressed import CompressedMatrix
    a = CompressedMatrix.from_csr(a.to_host(), "compressed-" + sys.argv[4], validate=False)
d = gpu.DeviceChunked.upload(a)
del a
cp.get_default_memory_pool().free_all_blocks()
gpu.chunked_onepass(d, g, f)
cp.cuda.Device().synchronize()
'''


def main(argv=None) -> int:
    import device_kernels as dk

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--rays", type=int, default=81)
    ap.add_argument("--options", default="", help="MLEM_CHUNK_ macros, comma-separated, without the prefix")
    ap.add_argument("--values", choices=("f32", "f16", "u16"), default="f32",
                    help="value type: the CSR's float32, or the matrix as compressed-f16 / compressed-u16")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dk.run_ncu(out / "ncu_chunked.txt", TARGET, f"{ROOT} {args.rays} '{args.options}' {args.values}",
               "--kernel-name regex:^chunked_onepass --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis "
               "--section MemoryWorkloadAnalysis_Tables --section Occupancy --section WarpStateStats "
               "--section LaunchStats --section SchedulerStats --section ComputeWorkloadAnalysis "
               "--metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio",
               r"chunked_onepass|Duration|Throughput|Occupancy|Registers|Stall|Bank|Hit|Eligible|Issued|"
               r"Shared|Pipe|Warp Cycles|Active Warps|stalled", timeout=500)
    return 0


if __name__ == "__main__":
    sys.exit(main())
