#!/usr/bin/env python3
"""Compile every CUDA source of the project with NVRTC on a machine without a GPU; report errors and spills.

NVRTC (the compiler CuPy uses at run time) needs no GPU. Get it once with
``pip download --no-deps -d /tmp/nvrtc nvidia-cuda-nvrtc-cu12`` and unzip the
wheel (or ``pip install nvidia-cuda-nvrtc-cu12``), then::

    python3 tools/nvrtc_check.py                               # finds the installed package
    python3 tools/nvrtc_check.py --lib /tmp/nvrtc/x/nvidia/cuda_nvrtc/lib/libnvrtc.so.12
    python3 tools/nvrtc_check.py --lib ... --cubin-dir /tmp/cubin   # then: cuobjdump -sass /tmp/cubin/X.cubin

Compiles ``mlemlib/kernels/*.cu`` with the options the library uses, and the
probe module of ``tools/device_onepass.py`` (compressed.cu's helpers plus
``tools/onepass_probe.cu``), for ``--arch`` (default sm_90) with ptxas's
resource report. Prints the kernels that spill (and those ``--kernels``
names) with their registers and spill bytes; exits 1 on a compile error (or
a spill, with ``--fail-on-spill``). A compile check only: whether a kernel is right and
fast is for the GPU (tools/README.md).
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

def _units() -> list[tuple[str, str, list[str]]]:
    """(label, source text, options) of every compilation unit the library and the probes build."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from mlemlib.backends._cuda_kernels import kernel_source  # the .cu files with their headers included

    cmp_src = kernel_source("compressed")
    probe = cmp_src[: cmp_src.index("// Entry points.")] + (ROOT / "tools" / "onepass_probe.cu").read_text()
    return [
        ("spmv.cu", kernel_source("spmv"), []),
        ("spmv.cu (vector atomics)", kernel_source("spmv"), ["-DMLEM_VECTOR_ATOMICS"]),
        ("compressed.cu (256 threads)", cmp_src, ["-DMLEM_CMP_THREADS=256"]),
        ("synth.cu", kernel_source("synth"), []),
        ("onepass probe (512 threads)", probe, ["-DPROBE_THREADS=512"]),
    ]


def _find_lib() -> str | None:
    try:
        import nvidia.cuda_nvrtc as pkg  # type: ignore[import-not-found]

        hits = glob.glob(str(Path(pkg.__path__[0]) / "lib" / "libnvrtc.so*"))
        hits = [h for h in hits if "builtins" not in h and ".alt." not in h]
        return hits[0] if hits else None
    except ImportError:
        return None


def compile_unit(lib, source: str, options: list[str]) -> tuple[int, str, bytes]:
    """(nvrtc status, compile log, cubin: empty on an error)."""
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"unit.cu", 0, None, None)
    if rc:
        return rc, "nvrtcCreateProgram failed", b""
    opts = [o.encode() for o in options]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    buf = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, buf)
    cubin = b""
    if not rc and not lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)) and size.value:
        bin_buf = ctypes.create_string_buffer(size.value)
        if not lib.nvrtcGetCUBIN(prog, bin_buf):
            cubin = bin_buf.raw
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, buf.value.decode(errors="replace"), cubin


def resources(log: str) -> dict[str, tuple[int, int]]:
    """{kernel: (registers, spill bytes stored + loaded)} from ptxas's -v report."""
    out: dict[str, tuple[int, int]] = {}
    name = None
    spill = 0
    for line in log.splitlines():
        m = re.search(r"Function properties for (\w+)", line)
        if m:
            name = m.group(1)
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and name:
            spill = int(m.group(1)) + int(m.group(2))
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and name:
            out[name] = (int(m.group(1)), spill)
            name = None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", help="path of libnvrtc.so (default: the installed nvidia-cuda-nvrtc package)")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--kernels", default="", help="regex: also print these kernels' resources")
    ap.add_argument("--fail-on-spill", action="store_true")
    ap.add_argument("--cubin-dir", help="also write each unit's cubin here (disassemble with cuobjdump -sass, "
                    "from the nvidia-cuda-cuobjdump wheel)")
    args = ap.parse_args(argv)
    path = args.lib or _find_lib()
    if not path:
        print("libnvrtc not found: pip install nvidia-cuda-nvrtc-cu12, or give --lib", file=sys.stderr)
        return 2
    lib = ctypes.CDLL(path)
    bad = 0
    for label, source, opts in _units():
        rc, log, cubin = compile_unit(lib, source, [f"--gpu-architecture={args.arch}", "--std=c++17",
                                             "--ptxas-options=-v", *opts])
        if rc:
            print(f"{label}: COMPILE ERROR (nvrtc {rc})\n{log}")
            bad = 1
            continue
        if args.cubin_dir and cubin:
            Path(args.cubin_dir).mkdir(parents=True, exist_ok=True)
            (Path(args.cubin_dir) / (re.sub(r"[^A-Za-z0-9]+", "_", label).strip("_") + ".cubin")).write_bytes(cubin)
        res = resources(log)
        spills = {k: v for k, v in res.items() if v[1]}
        print(f"{label}: {len(res)} kernels compiled, {len(spills)} with spills")
        for k, (regs, sp) in sorted(res.items()):
            if sp or (args.kernels and re.search(args.kernels, k)):
                print(f"  {k}: {regs} registers, {sp} spill bytes")
        bad |= bool(spills) and args.fail_on_spill
    return bad


if __name__ == "__main__":
    sys.exit(main())
