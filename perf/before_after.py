"""Time one MLEM configuration with two versions of mlemlib on the same machine; compare times and image bits.

A change that must keep every result bit for bit and every speed within noise (a refactor) is checked
by running the same configuration with the library before and after it, interleaved, on one machine:

    git worktree add /tmp/before <commit>        # or: git archive <commit> mlemlib | tar -x -C /tmp/before
    python3 perf/before_after.py run /tmp/before . MATRIX.h5 NORM.npy --fp auto --bp auto --gpus 1,2 -o checks.jsonl
    python3 perf/before_after.py table checks.jsonl --before <commit> --after <commit> --device "2 x H100" \\
        --title "..." -o perf/results/<dir>/checks.json      # `mlem bench page` shows it

``run`` starts one process per version and GPU count (each imports the library of its checkout, so the
two never mix), with the same synthetic measurement (the matrix's ``g.npy`` beside its norm where there
is one, as `mlem bench prepare` writes it, else ``g_i = 1 + i mod 7``), and appends one JSON line per
process: the backend's kernels, the median time per iteration over ``--iterations`` (CUDA events, as the
backend reports them, after 3 warm-up iterations), the set-up time and a hash of the final image. It uses
only the public API (``make_backend``, ``timed_iterations``, ``open_matrix``), which both versions must have.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def one(repo: str, label: str, matrix: str, norm_path: str, fp: str, bp: str, gpus: int, iterations: int,
        transpose: str | None) -> dict:
    """In this process: the library of ``repo``, one backend, ``iterations`` timed iterations."""
    sys.path.insert(0, os.path.abspath(repo))
    import numpy as np

    import mlemlib
    from mlemlib.backends import make_backend
    from mlemlib.backends.base import timed_iterations
    from mlemlib.formats import open_matrix

    if not os.path.abspath(mlemlib.__file__).startswith(os.path.abspath(repo)):
        raise SystemExit(f"imported {mlemlib.__file__}, not the library of {repo}")
    t0 = time.perf_counter()
    src = open_matrix(matrix)
    tr = open_matrix(transpose) if transpose else None
    m, n = src.shape
    if norm_path.endswith(".npy"):
        norm = np.load(norm_path)
        g_path = Path(norm_path).with_name("g.npy")
        g = np.load(g_path).astype(np.float32) if g_path.exists() else None
    else:
        from mlemlib.norm import read_norm

        norm, g = read_norm(norm_path, n), None
    if g is None:
        g = (1 + np.arange(m) % 7).astype(np.float32)
    be = make_backend("cuda", src, g, norm, tr, fp=fp, bp=bp, gpus=gpus, layout="local")
    setup = time.perf_counter() - t0
    f = be.initial_image()
    for _ in range(3):
        f = be.iterate(f)
    times = []
    for _it, f, ready in timed_iterations(be, f, 1, iterations):
        times += [t["iteration"] for _, t in ready]
    img = be.to_host(f)
    d = be.describe()
    if hasattr(be, "close"):
        be.close()
    return {"label": label, "matrix": Path(matrix).parent.name or Path(matrix).name, "fp_asked": fp,
            "bp_asked": bp, "fp": d.get("fp"), "bp": d.get("bp"), "gpus": gpus, "iterations": len(times),
            "median_ms": 1e3 * float(np.median(times)), "min_ms": 1e3 * float(np.min(times)),
            "setup_s": round(setup, 2), "image_sha": hashlib.sha256(img.tobytes()).hexdigest()[:16]}


def run(args: argparse.Namespace) -> int:
    """Each GPU count, the before and the after library in turn, one process each; append their lines."""
    for gpus in args.gpus:
        for label, repo in (("before", args.before), ("after", args.after)):
            cmd = [sys.executable, __file__, "one", repo, label, args.matrix, args.norm, args.fp, args.bp, str(gpus),
                   str(args.iterations)] + ([args.transpose] if args.transpose else [])
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
            rec = json.loads(lines[-1]) if p.returncode == 0 and lines else {
                "label": label, "fp_asked": args.fp, "bp_asked": args.bp, "gpus": gpus,
                "matrix": Path(args.matrix).parent.name, "error": (p.stderr.strip().splitlines() or ["?"])[-1]}
            print(json.dumps(rec), flush=True)
            with open(args.out, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(rec) + "\n")
    return 0


def table(args: argparse.Namespace) -> int:
    """Pair the lines of ``run`` (before, after) into a ``checks.json`` section for ``mlem bench page``."""
    recs = [json.loads(ln) for ln in Path(args.lines).read_text().splitlines() if ln.strip()]
    pairs: dict[tuple, dict] = {}
    for r in recs:
        key = (r["matrix"], r["fp_asked"], r["bp_asked"], r["gpus"])
        pairs.setdefault(key, {})[r["label"]] = r
    rows = []
    for (matrix, fp, bp, gpus), pr in pairs.items():
        b, a = pr.get("before", {}), pr.get("after", {})
        ran = a.get("bp") or b.get("bp") or bp
        rows.append({"matrix": matrix, "configuration": f"{fp}/{bp} ({ran})" if ran != bp else f"{fp}/{bp}",
                     "gpus": gpus, "before_ms": b.get("median_ms"), "after_ms": a.get("median_ms"),
                     "before_image": b.get("image_sha"), "after_image": a.get("image_sha"),
                     "image_note": "before: " + b["error"] if b.get("error") else
                     ("float atomics: not deterministic" if ran == "onepass" else "")})
    doc = {"checks": [{"title": args.title, "note": args.note, "date": args.date, "device": args.device,
                       "before": args.before_rev, "after": args.after_rev, "command": args.command, "rows": rows}]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "one":
        print(json.dumps(one(argv[1], argv[2], argv[3], argv[4], argv[5], argv[6], int(argv[7]), int(argv[8]),
                             argv[9] if len(argv) > 9 else None)), flush=True)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="time a configuration with both versions")
    r.add_argument("before")
    r.add_argument("after")
    r.add_argument("matrix")
    r.add_argument("norm")
    r.add_argument("--transpose")
    r.add_argument("--fp", default="auto")
    r.add_argument("--bp", default="auto")
    r.add_argument("--gpus", type=lambda s: [int(x) for x in s.split(",")], default=[1])
    r.add_argument("--iterations", type=int, default=50)
    r.add_argument("--timeout", type=int, default=300)
    r.add_argument("-o", "--out", required=True)
    t = sub.add_parser("table", help="the lines of run as a checks.json section")
    t.add_argument("lines")
    for k in ("title", "note", "date", "device", "before-rev", "after-rev", "command"):
        t.add_argument(f"--{k}", default="")
    t.add_argument("-o", "--out", required=True)
    args = ap.parse_args(argv)
    return run(args) if args.cmd == "run" else table(args)


if __name__ == "__main__":
    sys.exit(main())
