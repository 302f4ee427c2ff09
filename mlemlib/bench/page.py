"""``docs/performance.md`` from benchmark results: one Markdown table per device and case (host only).

The rows of one or more results directories (:mod:`mlemlib.bench.runner`)
are grouped by device and case; each table gives the kernel pair (and what
``auto`` ran), the GPU count, the median time per iteration, its share of the
floor (the bytes the iteration must read at the copy bandwidth measured in
the same run), the speed-up over the same run's 1-GPU time, cuSPARSE's time
in the same run and the thesis code's published figure for the same matrix,
device family and GPU count (a peers file, ``perf/peers.yaml``). Published
figures without a run of ours on their device are listed after the tables,
and a results directory's ``checks.json`` (``perf/before_after.py``: one
configuration with two versions of the library on one machine, times and
image bits) as its own section. The table of a case with OSEM subsets or
factors (its rows have ``subsets``) also gives S, the factors, the pass over
the same run's MLEM iteration, the time with factors over the time without
and the all-reduce's share of the pass; other tables are as before.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mlemlib.errors import ConfigError
from mlemlib.bench.threshold import has_threshold, threshold_text

PEER_KEYS = ("case", "device", "gpus", "ms", "source", "note")


def load_peers(path: str | os.PathLike | None) -> list[dict[str, Any]]:
    """The published figures of a peers file (``peers:`` a list of ``case, device, gpus, ms, source``).

    Raises
    ------
    ConfigError
        One line naming the file and the entry's key at fault.
    """
    if path is None:
        return []
    import yaml

    src = os.fspath(path)
    try:
        doc = yaml.safe_load(Path(src).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(src, f"cannot read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(src, f"not valid YAML: {getattr(exc, 'problem', None) or exc}") from None
    peers = (doc or {}).get("peers") if isinstance(doc, dict) else None
    if not isinstance(peers, list):
        raise ConfigError(src, "peers: expected a list of published figures")
    out = []
    for i, p in enumerate(peers):
        if not isinstance(p, dict):
            raise ConfigError(src, f"peers[{i}]: expected a mapping, got {p!r}")
        bad = sorted(set(p) - set(PEER_KEYS))
        if bad:
            raise ConfigError(src, f"peers[{i}].{bad[0]}: unknown key; expected some of {', '.join(PEER_KEYS)}")
        for key in ("case", "device", "source"):
            if not isinstance(p.get(key), str) or not p[key]:
                raise ConfigError(src, f"peers[{i}].{key}: expected text, got {p.get(key)!r}")
        if isinstance(p.get("gpus"), bool) or not isinstance(p.get("gpus"), int) or p["gpus"] < 1:
            raise ConfigError(src, f"peers[{i}].gpus: expected a GPU count >= 1, got {p.get('gpus')!r}")
        if isinstance(p.get("ms"), bool) or not isinstance(p.get("ms"), (int, float)) or not p["ms"] > 0:
            raise ConfigError(src, f"peers[{i}].ms: expected milliseconds per iteration > 0, got {p.get('ms')!r}")
        out.append(dict(p))
    return out


def _num(v: Any) -> float | None:
    if v is None or v == "":
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _ms(v: Any) -> str:
    f = _num(v)
    return "-" if f is None else f"{f:.3f}"


def configuration(r: dict[str, Any]) -> str:
    """``fp/bp`` as asked, what it ran where that differs, ``peer exchange`` where several GPUs summed the back
    projection over peer access, and ``non-det.`` for atomics."""
    fp, bp = r.get("fp"), r.get("bp")
    text = fp if fp == bp else f"{fp}/{bp}"
    ran = [k for k in (r.get("fp_kernel"), r.get("bp_kernel")) if k]
    if ran and (r.get("fp_kernel"), r.get("bp_kernel")) != (fp, bp):
        ran_text = ran[0] if len(set(ran)) == 1 else " + ".join(ran)
        text += f" ({ran_text})"
    if r.get("graph") in (True, "True", "true"):
        text += ", graphs"
    if r.get("exchange") == "peer":
        text += ", peer exchange"
    if r.get("deterministic") in (False, "False", "false"):
        text += ", non-det."
    return text


def peer_for(peers: Sequence[dict[str, Any]], case: str, device: str, gpus: int) -> dict[str, Any] | None:
    """The published figure of ``case`` on a device whose name contains the peer's ``device``, with ``gpus``."""
    for p in peers:
        if p["case"] == case and p["device"].lower() in str(device).lower() and int(p["gpus"]) == int(gpus):
            return p
    return None


def _ratio(v: Any) -> str:
    f = _num(v)
    return "-" if f is None else f"{f:.2f}x"


def _share(v: Any) -> str:
    f = _num(v)
    return "-" if f is None else f"{f:.1%}"


def _table(rows: list[dict[str, Any]], peers: Sequence[dict[str, Any]], used: set[int]) -> list[str]:
    osem = any("subsets" in r for r in rows)
    prior = any(r.get("prior", "none") != "none" for r in rows)
    threshold = any(has_threshold(r) for r in rows)
    head = ["configuration", *(["S", "m, b"] if osem else []), *(["MAP"] if prior else []), "GPUs",
            "ms per iteration (S > 1: per pass)" if osem else "ms per iteration",
            *(["pass / MLEM iteration", "with m, b / without", "all-reduce share"] if osem else []),
            *(["MAP pass / OSEM pass"] if prior else []),
            *(["to threshold (simulated NEMA)"] if threshold else []),
            "share of its floor", "speed-up vs 1 GPU", "cuSPARSE, same run (ms)", "thesis code (ms)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(rows, key=lambda r: (_model(r), int(r.get("gpus") or 0), _order(r))):
        gpus = int(r.get("gpus") or 0)
        peer = peer_for(peers, r["case"], r.get("device", ""), gpus)
        if peer is not None:
            used.add(id(peer))
        peer_cell = "-" if peer is None else f"{peer['ms']:.3f}"
        model = [str(_model(r)[0]), "synthetic" if r.get("factors") == "synthetic" else "-"] if osem else []
        if prior:
            model.append("-" if r.get("prior", "none") == "none" else f"BSREM, {r['prior']}")
        if r.get("error"):
            err = str(r["error"]).replace("|", "/")
            blanks = [""] * (len(head) - len(model) - 4)
            lines.append("| " + " | ".join([configuration(r), *model, str(gpus), f"not run: {err}", *blanks,
                                            peer_cell]) + " |")
            continue
        frac = _num(r.get("of_floor"))
        sp = _num(r.get("speedup"))
        ratios = [_ratio(r.get("pass_vs_mlem")), _ratio(r.get("factors_vs_none")),
                  _share(r.get("allreduce_share"))] if osem else []
        if prior:
            ratios.append(_ratio(r.get("prior_vs_none")))
        if threshold:
            ratios.append(f"failed: {r['threshold_error']}".replace("|", "/") if r.get("threshold_error")
                          else threshold_text(r))
        cells = [configuration(r), *model, str(gpus), _ms(r.get("ms")), *ratios, _share(frac),
                 "-" if sp is None else f"{sp:.2f}x", _ms(r.get("cusparse_ms")), peer_cell]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def scaling_line(rows: Sequence[dict[str, Any]]) -> str | None:
    """Whether each configuration (requested ``fp``/``bp``, subsets, factors) is never slower on more GPUs
    than on fewer in these rows (one run); None where none was timed on two GPU counts or more."""
    by: dict[tuple, dict[int, float]] = {}
    for r in rows:
        ms = _num(r.get("ms"))
        if r.get("error") or ms is None:
            continue
        key = (str(r.get("fp")), str(r.get("bp")), _model(r))
        by.setdefault(key, {})[int(r.get("gpus") or 0)] = ms
    counted = {k: v for k, v in by.items() if len(v) > 1}
    if not counted:
        return None
    slower = []
    for (fp, bp, (subsets, factors, prior)), times in sorted(counted.items()):
        gpus = sorted(times)
        for i, p in enumerate(gpus[1:], 1):
            q = min(gpus[:i], key=lambda g: times[g])
            if times[p] > times[q]:
                label = fp if fp == bp else f"{fp}/{bp}"
                label += (f", S = {subsets}" if subsets > 1 else "") + (", m, b" if factors else "") + (
                    ", MAP" if prior else "")
                slower.append(f"{label} on {p} GPUs {_ms(times[p])} ms against {_ms(times[q])} on {q}")
    counts = sorted({g for v in counted.values() for g in v})
    if not slower:
        return (f"More GPUs never slower: yes, every configuration timed on {', '.join(map(str, counts))} GPUs "
                "is no slower on more.")
    return "More GPUs never slower: no: " + "; ".join(slower) + "."


def _model(r: dict[str, Any]) -> tuple[int, int, int]:
    """(S, 0 without factors / 1 with, 0 without a prior / 1 with), for the order of a table's rows."""
    return (int(_num(r.get("subsets")) or 1), 0 if r.get("factors", "none") == "none" else 1,
            0 if r.get("prior", "none") == "none" else 1)


def _order(r: dict[str, Any]) -> tuple:
    return (r.get("fp") == "cusparse" and r.get("bp") == "cusparse", str(r.get("fp")), str(r.get("bp")))


def _facts_line(r: dict[str, Any]) -> str:
    parts = [f"{r.get('matrix')}", f"{r.get('order')} order", str(r.get("format"))]
    if r.get("folded") in (True, "True", "true"):
        parts.append("folded")
    shape = f"{int(r['m']):,} x {int(r['n']):,}" if _num(r.get("m")) and _num(r.get("n")) else "?"
    nnz = _num(r.get("nnz"))
    bpn = _num(r.get("bytes_per_nnz"))
    text = f"matrix: {', '.join(parts)}; {shape}, {int(nnz):,} non-zeros" if nnz else f"matrix: {', '.join(parts)}"
    if bpn:
        text += f", {bpn:.2f} bytes per non-zero"
    return text


def _checks(chk: dict[str, Any]) -> list[str]:
    """A before/after check (``checks.json`` of a results directory) as a section: one row per
    configuration, its time with each library version and whether the images are the same bits."""
    out = [f"## {chk.get('title', 'Before/after check')}", ""]
    if chk.get("note"):
        out += [str(chk["note"]), ""]
    out += [f"- date {chk.get('date')}; device {chk.get('device')}; before: {chk.get('before')}; after: "
            f"{chk.get('after')}; command: `{chk.get('command')}`", ""]
    out += ["| matrix | configuration | GPUs | before (ms) | after (ms) | change | image |",
            "|---|---|---|---|---|---|---|"]
    for r in chk.get("rows", []):
        b, a = _num(r.get("before_ms")), _num(r.get("after_ms"))
        change = f"{100 * (a / b - 1):+.1f}%" if a and b else "-"
        if r.get("before_image") and r.get("after_image"):
            image = "same bits" if r["before_image"] == r["after_image"] else "differs"
        else:
            image = "-"
        if r.get("image_note"):
            image += f" ({r['image_note']})"
        out.append(f"| {r.get('matrix')} | {r.get('configuration')} | {r.get('gpus')} | {_ms(b) if b else '-'} | "
                   f"{_ms(a) if a else '-'} | {change} | {image} |")
    out.append("")
    return out


def build_page(rows: Sequence[dict[str, Any]], peers: Sequence[dict[str, Any]] = (), *,
               sources: Sequence[str] = (), command: str = "", checks: Sequence[dict[str, Any]] = ()) -> str:
    """The Markdown page of ``rows`` (see the module docstring), with the before/after ``checks``."""
    out = [
        "# Performance",
        "",
        "Generated by `mlem bench page` from the results of `mlem bench run` (the cases are in",
        "`perf/cases.yaml`, the thesis code's published figures in `perf/peers.yaml`); do not edit by hand."
        + (f" Regenerate with `{command}`." if command else ""),
        "",
        "Per table: one device and one case. *ms per iteration*: the median over the repeats of each",
        "repeat's median MLEM iteration, timed as the backend reports it (CUDA events on a GPU). *Share of",
        "its floor*: the bytes the iteration must read (A and A^T for a pair, A once for a one pass, A twice",
        "without A^T; on several GPUs all of them) at the copy bandwidth measured in the same run, over the",
        "time. *Speed-up vs 1 GPU* and *cuSPARSE* come from the same run. *Thesis code*: the 2019 thesis's",
        "program on the same matrix, device family and GPU count, where it was measured. *More GPUs never",
        "slower*: for each configuration asked (its `fp`/`bp`, `auto` whatever it picks), whether its time",
        "on each GPU count is at most its least on fewer GPUs, in the same run.",
        "",
    ]
    if any("subsets" in r for r in rows):
        out += [
            "A case with OSEM subsets or factors has more columns. *S*: the subsets (one timed iteration of S > 1 is",
            "one full pass over the S subsets, on the matrix with its rows grouped by subset). *m, b*: synthetic",
            "multiplicative factors and background (`mlemlib/bench/factors.py`). *Pass / MLEM iteration*: the time",
            "over the same run's S = 1 time of the same configuration. *With m, b / without*: the time over the same",
            "configuration's without factors. *All-reduce share*: the median over the timed iterations of the",
            "all-reduces' time (the backend's `last_step_times()`) over the iteration's; where the iterations replay",
            "CUDA graphs, which hide the steps, of as many more iterations of the same backend launched kernel by kernel.",
            "*MAP*: BSREM passes with that prior (the relative difference prior, beta by the rule c = 0.25 of",
            "docs/reconstruction.md); *MAP pass / OSEM pass*: the time over the same configuration's without the prior.",
            "",
        ]
    if any("threshold_passes" in r for r in rows):
        out += [
            "*To threshold*: BSREM with the row's settings (and the case's subset halving) on the NEMA phantom",
            "simulated on the same matrix with attenuation, normalisation, randoms and scatter: the first pass at",
            "which both RMSEs (object, background) are below 1% and every sphere's mean below 0.5% of the converged",
            "MAP image's, and the iteration time to it, every pass's own time summed (`mlemlib/bench/threshold.py`).",
            "",
        ]
    if sources:
        out += ["Results: " + ", ".join(f"`{s}`" for s in sources) + ".", ""]
    # one table per device and case, and per commit where results of several commits are kept (their rows
    # would otherwise interleave)
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        key = (str(r.get("device_kind") or r.get("device")), str(r["case"]), str(r.get("commit") or "?"))
        groups.setdefault(key, []).append(r)
    commits = Counter(key[:2] for key in groups)  # tables of each device and case
    used: set[int] = set()
    for (kind, case, commit), rs in sorted(groups.items(), key=lambda kv: (kv[0][:2], str(kv[1][0].get("date")))):
        first = rs[0]
        out += [f"## {case} on {kind}" + (f", commit {commit}" if commits[(kind, case)] > 1 else ""), ""]
        if first.get("description"):
            out += [str(first["description"]), ""]
        runs = list(dict.fromkeys((str(r.get("date")), str(r.get("command")), str(r.get("commit") or "?"))
                                  for r in rs))
        for date, cmd, commit in runs:
            out.append(f"- date {date}; device {first.get('device')} ({kind}); commit {commit}; command: `{cmd}`")
        it = first.get("iterations")
        out += [f"- {_facts_line(first)}; timed: {first.get('warmup')} warm-up iterations, then "
                f"{first.get('repeats')} repeats of {it} iterations", ""]
        out += _table(rs, peers, used)
        line = scaling_line(rs)
        out += ["", line] if line else []
        out.append("")
    for chk in checks:
        out += _checks(chk)
    left = [p for p in peers if id(p) not in used]
    if left:
        out += [
            "## Thesis code figures awaiting a run of ours on their device",
            "",
            "| case | device | GPUs | thesis code (ms) | source |",
            "|---|---|---|---|---|",
        ]
        for p in left:
            note = f" ({p['note']})" if p.get("note") else ""
            out.append(f"| {p['case']} | {p['device']} | {p['gpus']} | {p['ms']:.3f} | {p['source']}{note} |")
        out.append("")
    if not rows:
        out += ["No results yet.", ""]
    return "\n".join(out)


def write_page(results: Sequence[str | os.PathLike], out: str | os.PathLike, *, peers: str | os.PathLike | None = None,
               command: str = "") -> str:
    """Read the results directories (or ``results.json`` files), write the page to ``out``; return its text."""
    from mlemlib._io import atomic_path
    from mlemlib.bench.runner import read_results

    import json

    rows: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    for d in results:
        p = Path(d)
        base = p.parent if p.name == "results.json" else p
        doc = read_results(base)
        if not doc["rows"]:
            raise ConfigError(os.fspath(p), "no results.json with rows here (run mlem bench run --out DIR first)")
        rows += doc["rows"]
        if (base / "checks.json").exists():
            try:
                checks += json.loads((base / "checks.json").read_text(encoding="utf-8"))["checks"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ConfigError(os.fspath(base / "checks.json"), f"not a checks file: {exc}") from None
    text = build_page(rows, load_peers(peers), sources=[os.fspath(d) for d in results], command=command,
                      checks=checks)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        Path(tmp).write_text(text, encoding="utf-8")
    return text
