"""The configuration space a run may ask for, and which of its combinations run (every backend).

A run is a matrix variant (format, fold, reorder), a model (OSEM subsets S,
the factors ``m`` and ``b`` or none, MAP's prior or none) and an execution
(backend, ``fp``/``bp`` kernels, GPU count, layout, CUDA graphs). MAP (BSREM
with the relative difference prior, with the ``em`` preconditioner, with the
``hessian`` one and an offset, with those and each pass's mean image, and with the subsets halving after
passes 1 and 2; OSL with the RDP; BSREM with the RDP and per-voxel weights kappa; BSREM with the quadratic
prior) is taken with every model and every
backend, GPU count and layout, with the kernels ``auto`` (the kernel families
under MAP are tests/test_map.py's). :func:`space` enumerates the
combinations the configuration schema accepts, the kernels drawn from
:mod:`mlemlib.registry`; :func:`check` is the verdict the workflow's dry run
gives each (matrix, run) pair: nothing, or a :class:`~mlemlib.errors.ConfigError`
naming the setting that does not go with the others. Every combination
:func:`check` accepts must run and meet the numerical contract (tests/test_compose.py
runs them: the CPU ones in CI, the cuda ones on a GPU); :func:`table` renders the
outcomes as docs/combinations.md.
"""

from __future__ import annotations

import itertools
import json
import os
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from mlemlib import registry
from mlemlib.errors import ConfigError
from mlemlib.formats.spec import matrix_format_of
from mlemlib.map import check_halving

#: The matrix formats of the configuration (``matrices.<name>.format``).
FORMATS = registry.FORMATS
#: ``reorder`` values; OSEM subsets S of the space (1: MLEM); the graph settings (``auto``, ``off``).
REORDERS = ("none", "rows+voxels")
SUBSETS = (1, 4)
GRAPHS = ("auto", "off")
#: MAP's prior of a run: none (MLEM/OSEM), the relative difference prior (BSREM), the same with the
#: ``hessian`` preconditioner and an offset (the step's other branches), and with those and the pass's mean
#: as its image (``averaging: pass``), BSREM whose subsets halve after passes 1 and 2 (``subset_halving``;
#: S divisible by 4), OSL with the RDP (``algorithm: osl``), BSREM with the RDP and per-voxel weights
#: (``prior.kappa``) and BSREM with the quadratic prior (``prior.type: quadratic``).
PRIORS = ("none", "rdp", "rdp-offset", "rdp-mean", "rdp-halving", "osl", "rdp-kappa", "quadratic")
#: The passes after which ``rdp-halving``'s subsets halve.
HALVING = (1, 2)
#: GPU counts the cuda tier covers, and the layouts of a multi-GPU run.
GPU_COUNTS = (1, 2)
LAYOUTS = registry.LAYOUTS


@dataclass(frozen=True)
class Combination:
    """One point of the space: what one run of one matrix models and how it executes."""

    format: str
    fold: bool
    reorder: str
    subsets: int
    factors: bool  # m and b (attenuation, normalisation, randoms, scatter) or none
    backend: str
    fp: str
    bp: str
    gpus: int = 1
    layout: str = "local"
    graph: str = "auto"  # "auto" or "off" in the space; "on" where a run forces graphs (graph: true)
    prior: str = "none"  # one of PRIORS but "none": MAP

    @property
    def model(self) -> tuple[str, bool, str, int, bool]:
        """What the float64 reference of the run depends on (its matrix variant and model)."""
        return (self.format, self.fold, self.reorder, self.subsets, self.factors)

    def label(self) -> str:
        """A short name: ``csr fold rows+voxels S4 m+b | cpu numba/auto``."""
        model = " ".join(p for p in (self.format, "fold" if self.fold else "", self.reorder if self.reorder != "none"
                                     else "", f"S{self.subsets}", "m+b" if self.factors else "") if p)
        run = f"{self.backend} {self.fp}/{self.bp}" + (f" MAP {self.prior}" if self.prior != "none" else "")
        if self.backend == "cuda":
            run += f" {self.gpus} GPU" + (f" {self.layout}" if self.gpus > 1 else "") + f" graph {self.graph}"
        return f"{model} | {run}"


def kernel_choices(backend: str) -> list[tuple[str, str]]:
    """The ``(fp, bp)`` pairs of a backend that cover every kernel the registry offers: ``auto``/``auto``,
    each forward kernel with ``bp: auto`` and each back projection (stored-transpose, no-transpose and
    whole-iteration) with ``fp: auto``; selectors (``notrans``) included. Formats are not filtered here:
    :func:`check` refuses a kernel that does not read the matrix's format."""
    fps = registry.names(backend, *registry.KEY_OPS["fp"])
    bps = registry.names(backend, *registry.KEY_OPS["bp"])
    return [("auto", "auto")] + [(fp, "auto") for fp in fps] + [("auto", bp) for bp in bps]


def models() -> Iterator[tuple[str, bool, str, int, bool]]:
    """Every (format, fold, reorder, S, factors) of the space."""
    return itertools.product(FORMATS, (False, True), REORDERS, SUBSETS, (False, True))


def space(backends: Iterable[str] = ("cpu", "cuda"), gpu_counts: Iterable[int] = GPU_COUNTS) -> Iterator[Combination]:
    """Every combination of the space for ``backends`` (cuda: each GPU count of ``gpu_counts``, each layout
    where there are several, each graph setting)."""
    gpu_counts = tuple(gpu_counts)
    for backend in backends:
        pairs = kernel_choices(backend)
        for (fmt, fold, reorder, subsets, factors), (fp, bp) in itertools.product(models(), pairs):
            base = dict(format=fmt, fold=fold, reorder=reorder, subsets=subsets, factors=factors, backend=backend,
                        fp=fp, bp=bp)
            if backend == "cpu":
                yield Combination(**base)
                if (fp, bp) == ("auto", "auto"):
                    for prior in PRIORS[1:]:
                        yield Combination(**base, prior=prior)
                continue
            for gpus in gpu_counts:
                for layout in LAYOUTS if gpus > 1 else ("local",):
                    for graph in GRAPHS:
                        yield Combination(**base, gpus=gpus, layout=layout, graph=graph)
                    if (fp, bp) == ("auto", "auto"):
                        for prior in PRIORS[1:]:
                            yield Combination(**base, gpus=gpus, layout=layout, prior=prior)


def check(c: Combination, where: str = "run") -> None:
    """The dry run's verdict on one combination: return where it runs, raise where it does not.

    Raises
    ------
    ConfigError
        One line naming the setting (``where.fp``, ``where.bp``, ``where.gpus``, ``where.layout``) that does
        not go with the matrix's format or the model.
    """
    if c.format not in FORMATS:
        raise ConfigError(f"{where}.format", f"unknown matrix format {c.format!r}, expected one of {', '.join(FORMATS)}")
    if c.prior not in PRIORS:
        raise ConfigError(f"{where}.prior", f"unknown prior {c.prior!r}, expected one of {', '.join(PRIORS)}")
    if c.backend == "cpu" and c.gpus != 1:
        raise ConfigError(f"{where}.gpus", f"a run with backend cpu takes 1, found {c.gpus}")
    layout = c.layout if c.gpus > 1 else None
    for key in ("fp", "bp"):
        registry.check(key, getattr(c, key), c.backend, gpus=c.gpus, layout=layout, where=f"{where}.{key}",
                       fmt=c.format)
    if c.subsets > 1 and c.gpus > 1 and c.layout == "thesis":
        raise ConfigError(f"{where}.layout", f"OSEM (subsets {c.subsets}) runs in the local layout; the thesis "
                                             "layout's correlation spans every row")
    if c.backend == "cpu" and c.bp == "onepass_chunked" and c.factors:
        raise ConfigError(f"{where}.bp", "onepass_chunked on the cpu takes no additive background (b); use "
                                         "onepass or numba")
    if (c.backend == "cuda" and c.subsets > 1 and not matrix_format_of(c.format).cusparse
            and c.bp not in (None, "auto") and registry.get_bp("cuda", c.bp).op == "back"):
        raise ConfigError(f"{where}.bp", f"{c.bp} back-projects on a stored A^T, which OSEM (subsets {c.subsets}) "
                                         f"cannot have on the GPUs for a {c.format} matrix; use bp: auto or a "
                                         "one-pass kernel (onepass, onepass_fixed, onepass_chunked), or format: csr")
    if c.prior == "rdp-halving":
        try:
            check_halving(HALVING, c.subsets)
        except ConfigError as exc:
            raise ConfigError(f"{where}.subsets", f"mlem.{exc}") from None


def reads_transpose(c: Combination) -> bool:
    """Whether the run reads the matrix's stored ``A^T`` (``transpose.h5``), as the workflow gives it: a cpu run
    whose back projection reads ``A^T`` (``auto`` included), a thesis-layout run, and a one-GPU run of such a
    kernel on a compressed matrix (a GPU transposes a CSR matrix, or its block of rows, itself), except where
    ``graph`` is ``on`` (the workflow's ``graph: true``), ``bp`` names the kernel and there are no subsets: that
    run takes the several-GPU backend, which reads its ``A_k^T`` from the partition's part files
    (:func:`needs_part_files`)."""
    if not registry.uses_transpose(c.backend, c.bp):
        return False
    if c.backend != "cuda":
        return True
    if c.gpus > 1:
        return c.layout == "thesis"
    if c.graph == "on" and c.subsets == 1 and c.bp not in (None, "auto"):
        return False
    return not matrix_format_of(c.format).cusparse


def needs_part_files(c: Combination) -> bool:
    """Whether the run back-projects on each GPU's ``A_k^T`` read from the partition's part files (the workflow's
    ``partition_matrix`` writes them, ``mlem partition --local-transpose``): a cuda run of the local layout whose
    ``bp`` reads ``A^T`` (``auto`` included), on a compressed matrix (the GPUs transpose a block of a CSR matrix
    themselves), without OSEM subsets (each subset's GPUs use their own rows); on one GPU only where ``graph`` is
    ``on`` and ``bp`` names the kernel (that run takes the several-GPU backend; ``auto`` there takes a one pass,
    which needs no ``A_k^T``)."""
    if c.backend != "cuda" or c.layout != "local" or c.subsets > 1:
        return False
    if matrix_format_of(c.format).cusparse or not registry.uses_transpose("cuda", c.bp):
        return False
    if c.gpus > 1:
        return True
    return c.graph == "on" and c.bp not in (None, "auto")


def verdict(c: Combination) -> str | None:
    """None where :func:`check` accepts the combination, else its one-line refusal."""
    try:
        check(c)
    except ConfigError as exc:
        return str(exc)
    return None


def record(path: str | os.PathLike, c: Combination, outcome: str, detail: str = "") -> None:
    """Append one outcome (``refused``, ``ran``, ``FAILED``) as a JSON line to ``path`` (the tiers' results)."""
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({**asdict(c), "outcome": outcome, "detail": detail}) + "\n")


def table(lines: Iterable[str], planned: Iterable[Combination] | None = None) -> str:
    """docs/combinations.md's tables from the tiers' JSON lines (:func:`record`).

    The first counts the outcomes per backend and GPU count; the second has one row per execution (backend,
    ``fp``/``bp``, GPUs, layout, graphs) with its outcomes over the 64 models (format x fold x reorder x S x
    factors) and each distinct refusal or failure (the line up to its first ``;``) with the models it
    concerns. ``planned`` (default: the whole :func:`space`) adds what no tier ran as "not run": whole executions,
    and the models of an execution a tier did not reach (one stopped at its time limit). A combination with
    several results (a tier run again on part of the space) counts once, with its last one in ``lines``.
    """
    keys = ("backend", "fp", "bp", "gpus", "layout", "graph", "prior")
    whole = ("format", "fold", "reorder", "subsets", "factors", *keys)
    latest: dict[tuple, dict[str, Any]] = {}
    for t in lines:
        if t.strip():
            r = json.loads(t)
            r.setdefault("prior", "none")  # the tiers' results from before MAP was in the space
            latest[tuple(r[k] for k in whole)] = r  # a combination run again: its last outcome
    rows = list(latest.values())
    seen = {tuple(r[k] for k in keys) for r in rows}
    planned = list(space()) if planned is None else list(planned)
    unrun = [c for c in planned if tuple(getattr(c, k) for k in whole) not in latest]  # a tier stopped early too
    unrun_of = Counter(tuple(getattr(c, k) for k in keys) for c in unrun)  # per execution
    missing = sorted(set(unrun_of) - seen, key=str)
    out = ["| backend | GPUs | combinations | ran within 1e-5 of the float64 reference | refused by the dry run | failed | not run |",
           "|---|---|---|---|---|---|---|"]
    for backend, gpus in sorted({(r["backend"], r["gpus"]) for r in rows} | {(k[0], k[3]) for k in missing}):
        sel = [r for r in rows if r["backend"] == backend and r["gpus"] == gpus]
        count = {k: sum(r["outcome"] == k for r in sel) for k in ("ran", "refused", "FAILED")}
        absent = sum(1 for c in unrun if (c.backend, c.gpus) == (backend, gpus))
        out.append(f"| {backend} | {gpus} | {len(sel) + absent} | {count['ran']} | {count['refused']} | "
                   f"{count['FAILED']} | {absent} |")
    out += ["", "| backend | fp / bp | GPUs, layout, graph | ran | refused | failed | why refused or failed (models) |",
            "|---|---|---|---|---|---|---|"]
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    for key in sorted(groups, key=lambda k: (k[0], k[3], k[4], k[5], k[6], k[1], k[2])):
        sel = groups[key]
        count = {k: sum(r["outcome"] == k for r in sel) for k in ("ran", "refused", "FAILED")}
        why: dict[str, list[str]] = {}
        for r in sel:
            if r["outcome"] != "ran":
                c = Combination(**{k: v for k, v in r.items() if k not in ("outcome", "detail")})
                reason = r["detail"].split(";")[0].replace(f"the {c.format} format", "the matrix's format").replace(
                    f"a {c.format} matrix", "a compressed matrix")
                why.setdefault(f"{r['outcome'].lower()}: {reason}", []).append(c.label().split(" | ")[0])
        notes = "; ".join(f"{w} ({_models(ms)})" for w, ms in why.items()).replace("|", "/")
        if unrun_of.get(key):
            notes = "; ".join(n for n in (notes, f"not run yet: {unrun_of[key]} of its models") if n)
        backend, fp, bp, gpus, layout, graph, prior = key
        ex = f"{gpus}" + (f", {layout}" if gpus > 1 else "") + (f", graph {graph}" if backend == "cuda" else "")
        fp = fp if prior == "none" else f"MAP ({prior}): {fp}"
        out.append(f"| {backend} | {fp} / {bp} | {ex} | {count['ran']} | {count['refused']} | {count['FAILED']} | "
                   f"{notes or '-'} |")
    for backend, fp, bp, gpus, layout, graph, prior in missing:
        ex = f"{gpus}" + (f", {layout}" if gpus > 1 else "") + (f", graph {graph}" if backend == "cuda" else "")
        fp = fp if prior == "none" else f"MAP ({prior}): {fp}"
        why = f"not run: no machine of {gpus} GPUs" if gpus > 1 else "not run yet"
        out.append(f"| {backend} | {fp} / {bp} | {ex} | - | - | - | {why} |")
    return "\n".join(out) + "\n"


def _models(labels: list[str]) -> str:
    """The models a note concerns: all of them, or the formats/subsets they share, else a count."""
    n = len(labels)
    if n == 64:
        return "every model"
    fmts = sorted({lab.split()[0] for lab in labels})
    subsets = sorted({p for lab in labels for p in lab.split() if p.startswith("S") and p[1:].isdigit()})
    return f"{n} of 64: {', '.join(fmts)}; {', '.join(subsets)}"


def main(argv: list[str] | None = None) -> int:
    """``python -m mlemlib.compose FILE...``: print docs/combinations.md's table from the tiers' JSON lines."""
    import sys

    paths = sys.argv[1:] if argv is None else argv
    lines: list[str] = []
    for p in paths:
        with open(p, encoding="utf-8") as fh:
            lines += fh.readlines()
    sys.stdout.write(table(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
