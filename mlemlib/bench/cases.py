"""The benchmark cases file: named workloads (matrix, LOR order, format, kernels, GPU counts); host only.

A cases file (YAML, ``perf/cases.yaml``) has an optional ``defaults``
mapping, merged into every case, and a list ``cases``. Each case::

    name: madpet2-own-csr            # unique; [A-Za-z0-9_.-]
    description: one line for the page
    matrix: madpet2                  # a preset of `mlem generate`, {preset: NAME, rays: N},
                                     # {tor: [NX, NY, NZ, ANGLES, OFFSETS], width: W} or {path: FILE}
    fold: false                      # store each line of response once (presets, or mlem fold)
    voxel_order: raster              # raster | hilbert (presets)
    order: own                       # own | shuffled | reordered | shuffled-reordered
    format: csr                      # csr | compressed | compressed-f16 | compressed-u16
    kernels: [csr_vector/csr_vector, auto]   # FP/BP pairs; one name X means X/X (auto/X for a one pass)
    cusparse: true                   # time the cuSPARSE pair as the reference (on a CSR copy)
    gpus: [1, 2, 4]
    backend: cuda                    # cuda | cpu
    layout: local                    # local | thesis (several GPUs)
    graph: auto                      # replay iterations as CUDA graphs: auto (MLEM on several GPUs), true, false
    warmup: 5                        # untimed iterations first
    iterations: 20                   # timed iterations per repeat
    repeats: 3                       # repeats (the figure is the median of their medians)
    seed: 0                          # of the shuffled order and of synthetic factors
    subsets: [1]                     # OSEM subset counts S; S > 1 times one full pass over the S subsets
    factors: [none]                  # none | synthetic (multiplicative m and background b), or a list of both
    prior: [none]                    # none | rdp | rdp-fast (MAP: BSREM with the relative difference prior), or a list
    threshold:                       # optional (a case with a prior): each MAP row also measures its time to
      counts: 10000000               #   threshold on the NEMA phantom simulated with every effect
      passes: 60                     #   (mlemlib/bench/threshold.py): the run's passes,
      converged_passes: 3000         #   the converged image's,
      subset_halving: [30, 40]       #   the run's subsets halving after these passes
      seed: 1                        #   the Poisson draw's seed

A case that lists ``subsets`` other than ``[1]``, ``factors`` other than
``[none]`` or a ``prior`` is timed once per S, factor setting and prior
(:meth:`Case.variants`), each row beside the same configuration's S = 1,
factor-free and prior-free times. The prior ``rdp`` times BSREM passes
(:class:`mlemlib.map.MapBackend`) with the RDP on the matrix's voxel grid:
``gamma = 2``, ``beta`` by the rule ``c = beta * 19.1 / mean(s) = 0.25`` and
``epsilon`` 1e-3 of the initial image's value (docs/reconstruction.md), the
default settings (the ``em`` preconditioner, relaxation (1, 10), each pass's
last sub-iterate); ``rdp-fast`` the same prior with the fastest settings
measured to the MAP image (the ``hessian`` preconditioner, the offset 0.35,
relaxation (1, 30)) but its subset halving, so that every timed pass runs all
S sub-iterations. With ``threshold`` each MAP row also holds its time to
threshold (:mod:`mlemlib.bench.threshold`): BSREM with the row's settings and
the threshold's ``subset_halving``, measured as PETRIC does against the
converged image of a simulated NEMA measurement.

:func:`load_cases` checks every key and value; a fault is one
:class:`~mlemlib.errors.ConfigError` naming the file, the case and the key.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from mlemlib import registry
from mlemlib.errors import ConfigError

ORDERS = ("own", "shuffled", "reordered", "shuffled-reordered")
BACKENDS = ("cuda", "cpu")
LAYOUTS = registry.LAYOUTS
VOXEL_ORDERS = ("raster", "hilbert")
#: What a case models beyond MLEM's ``g / A f``: nothing, or synthetic factors ``m`` and background ``b``
#: (:mod:`mlemlib.bench.factors`).
FACTORS = ("none", "synthetic")
#: MAP's prior of a row: none, or BSREM with the relative difference prior (rdp-fast: with the fastest settings).
PRIORS = ("none", "rdp", "rdp-fast")
#: The bench prior ``rdp-fast``'s BSREM settings: those of the fastest run to the MAP image measured on madpet2
#: (docs/reconstruction.md) but its subset halving, so that every timed pass runs all S sub-iterations (the
#: dearest pass of that run).
FAST_MAP = {"preconditioner": "hessian", "preconditioner_offset": 0.35, "relaxation": (1.0, 30.0)}
#: The reference pair timed where a case asks for ``cusparse``.
CUSPARSE = ("cusparse", "cusparse")

DEFAULTS: dict[str, Any] = {
    "description": "",
    "fold": False,
    "voxel_order": "raster",
    "order": "own",
    "format": "csr",
    "kernels": ["auto"],
    "cusparse": True,
    "gpus": [1],
    "backend": "cuda",
    "layout": "local",
    "graph": "auto",
    "warmup": 5,
    "iterations": 20,
    "repeats": 3,
    "seed": 0,
    "subsets": [1],
    "factors": ["none"],
    "prior": ["none"],
    "threshold": None,
}
CASE_KEYS = ("name", "matrix", *DEFAULTS)
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class MatrixSpec:
    """Where a case's matrix comes from: exactly one of ``preset``, ``tor``, ``path``."""

    preset: str | None = None
    rays: int | None = None
    tor: tuple[int, int, int, int, int] | None = None
    width: float = 3.0
    path: str | None = None

    @property
    def label(self) -> str:
        if self.preset is not None:
            return self.preset + (f" ({self.rays} rays)" if self.rays else "")
        if self.tor is not None:
            return "TOR " + "x".join(str(v) for v in self.tor)
        return Path(self.path or "").name


@dataclass(frozen=True)
class Threshold:
    """A MAP case's time-to-threshold measurement (:mod:`mlemlib.bench.threshold`)."""

    counts: float = 1.0e7
    passes: int = 60
    converged_passes: int = 3000
    subset_halving: tuple[int, ...] = ()
    seed: int = 1


THRESHOLD_KEYS = tuple(f.name for f in fields(Threshold))


@dataclass(frozen=True)
class Case:
    """One named workload of the cases file."""

    name: str
    matrix: MatrixSpec
    description: str = ""
    fold: bool = False
    voxel_order: str = "raster"
    order: str = "own"
    format: str = "csr"
    kernels: tuple[tuple[str, str], ...] = (("auto", "auto"),)
    cusparse: bool = True
    gpus: tuple[int, ...] = (1,)
    backend: str = "cuda"
    layout: str = "local"
    graph: bool | str = "auto"  # "auto": as the backend decides (graphs for MLEM on several GPUs)
    warmup: int = 5
    iterations: int = 20
    repeats: int = 3
    seed: int = 0
    subsets: tuple[int, ...] = (1,)
    factors: tuple[str, ...] = ("none",)
    prior: tuple[str, ...] = ("none",)
    threshold: Threshold | None = None
    source: str = field(default="", compare=False)

    @property
    def osem(self) -> bool:
        """Whether the case times subsets, factors or a prior (its rows then carry S, the factors, the prior and
        their ratios)."""
        return self.subsets != (1,) or self.factors != ("none",) or self.prior != ("none",)

    def variants(self) -> list[tuple[int, str]]:
        """The (S, factors) settings timed, S = 1 and ``none`` first where listed (the ratios' references)."""
        return [(s, f) for s in sorted(self.subsets) for f in sorted(self.factors, key=FACTORS.index)]

    def pairs(self, subsets: int = 1, factors: str = "none", prior: str = "none") -> list[tuple[str, str]]:
        """The kernel pairs timed: the case's, then the cuSPARSE reference where asked (cuda only; MLEM without
        factors or prior only)."""
        out = list(dict.fromkeys(self.kernels))
        if (self.cusparse and self.backend == "cuda" and CUSPARSE not in out and subsets == 1
                and factors == "none" and prior == "none"):
            out.append(CUSPARSE)
        return out

    def matrix_settings(self, subsets: int = 1) -> dict[str, Any]:
        """What defines the prepared matrix (the cache key's content); ``subsets`` S > 1: its rows grouped by
        the S subsets."""
        spec = {k: v for k, v in asdict(self.matrix).items() if v is not None}
        if self.matrix.path is not None:
            p = Path(self.matrix.path)
            st = p.stat() if p.exists() else None
            spec["path"] = os.fspath(p.resolve())
            spec["stamp"] = [st.st_size, int(st.st_mtime)] if st else None
        out = {"matrix": spec, "fold": self.fold, "order": self.order, "format": self.format}
        if self.matrix.preset is not None:
            out["voxel_order"] = self.voxel_order
        if "shuffled" in self.order:
            out["seed"] = self.seed
        if subsets > 1:
            out["subsets"] = subsets
        return out

    def matrix_key(self, subsets: int = 1) -> str:
        """A short name + hash of :meth:`matrix_settings`: the prepared matrix's directory."""
        return settings_key(self.matrix_settings(subsets))


def bench_settings(prior: str) -> dict[str, Any]:
    """The BSREM settings of a bench prior beyond the RDP's weights: none for ``rdp`` (the defaults),
    :data:`FAST_MAP` for ``rdp-fast``."""
    return dict(FAST_MAP) if prior == "rdp-fast" else {}


def rdp_weights(s_mean: float, s_sum: float, counts: float) -> tuple[float, float]:
    """The bench's RDP ``(beta, epsilon)`` (``gamma = 2``), as docs/reconstruction.md chooses them: ``beta`` by
    the rule ``c = beta * 19.1 / mean(s) = 0.25`` and ``epsilon`` 1e-3 of the initial image's value
    ``sum g / sum s`` (``s`` the sensitivities, ``m`` included)."""
    return 0.25 * float(s_mean) / 19.1, 1e-3 * float(counts) / float(s_sum)


def settings_key(settings: dict[str, Any]) -> str:
    """``<readable>-<12 hex>`` of a settings dict (sorted JSON, blake2b)."""
    text = json.dumps(settings, sort_keys=True, default=str)
    digest = hashlib.blake2b(text.encode(), digest_size=6).hexdigest()
    m = settings.get("matrix", {})
    base = m.get("preset") or ("tor" if m.get("tor") else Path(str(m.get("path", "matrix"))).stem)
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{base}-{digest}")


def _fault(source: str, where: str, fault: str) -> ConfigError:
    return ConfigError(source, f"{where}: {fault}")


def _bool(v: Any, src: str, where: str) -> bool:
    if not isinstance(v, bool):
        raise _fault(src, where, f"expected true or false, got {v!r}")
    return v


def _int(v: Any, src: str, where: str, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise _fault(src, where, f"expected an integer >= {lo}, got {v!r}")
    return v


def _choice(v: Any, src: str, where: str, choices: tuple[str, ...]) -> str:
    if v not in choices:
        raise _fault(src, where, f"expected one of {', '.join(choices)}, got {v!r}")
    return v


def _int_list(v: Any, src: str, where: str, what: str) -> tuple[int, ...]:
    """A list of integers >= 1 (one integer is a list of one), duplicates dropped, in the given order."""
    if isinstance(v, int) and not isinstance(v, bool):
        v = [v]
    if not isinstance(v, list) or not v:
        raise _fault(src, where, f"expected a list of {what}, got {v!r}")
    return tuple(dict.fromkeys(_int(x, src, where, 1) for x in v))


def _names(v: Any, src: str, where: str, choices: tuple[str, ...]) -> tuple[str, ...]:
    """One of ``choices`` or a non-empty list of them, in the order of ``choices``."""
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not items or any(x not in choices for x in items):
        raise _fault(src, where, f"expected {', '.join(choices[:-1])} or {choices[-1]}, or a list of them, got {v!r}")
    return tuple(sorted(dict.fromkeys(items), key=choices.index))


def parse_pair(item: Any, src: str, where: str) -> tuple[str, str]:
    """``"FP/BP"``, ``"X"`` (``X/X``) or ``[FP, BP]`` as ``(fp, bp)``; names checked against the registry."""
    if isinstance(item, str):
        parts = [p.strip() for p in item.split("/")]
        if len(parts) == 1:  # X/X, or auto/X for a whole-iteration kernel (it has no forward kernel of its own)
            parts = parts * 2 if parts[0] in registry.all_names("fp") else ["auto", parts[0]]
    elif isinstance(item, (list, tuple)):
        parts = list(item)
    else:
        parts = []
    if len(parts) != 2 or not all(isinstance(p, str) and p for p in parts):
        raise _fault(src, where, f"expected FP/BP, a single kernel name or [FP, BP], got {item!r}")
    fp, bp = parts
    if fp not in registry.all_names("fp"):
        raise _fault(src, where, f"unknown forward-projection kernel {fp!r}; valid: {', '.join(registry.all_names('fp'))}")
    if bp not in registry.all_names("bp"):
        raise _fault(src, where, f"unknown back-projection kernel {bp!r}; valid: {', '.join(registry.all_names('bp'))}")
    return fp, bp


def parse_matrix(v: Any, src: str, where: str, base: Path) -> MatrixSpec:
    """A case's ``matrix``: a preset name, a path, or a mapping with ``preset``, ``tor`` or ``path``."""
    from mlemlib.scanner.presets import PRESETS

    if isinstance(v, str):
        v = {"preset": v} if v in PRESETS else {"path": v}
    if not isinstance(v, dict):
        raise _fault(src, where, f"expected a preset name, a path or a mapping, got {v!r}")
    unknown = sorted(set(v) - {"preset", "rays", "tor", "width", "path"})
    if unknown:
        raise _fault(src, f"{where}.{unknown[0]}", "unknown key; expected preset (+ rays), tor (+ width) or path")
    given = [k for k in ("preset", "tor", "path") if k in v]
    if len(given) != 1:
        raise _fault(src, where, f"give exactly one of preset, tor, path; got {', '.join(given) or 'none'}")
    if "preset" in v:
        if v["preset"] not in PRESETS:
            raise _fault(src, f"{where}.preset", f"unknown preset {v['preset']!r}; expected one of {', '.join(PRESETS)}")
        rays = _int(v["rays"], src, f"{where}.rays", 1) if v.get("rays") is not None else None
        return MatrixSpec(preset=v["preset"], rays=rays)
    if "rays" in v:
        raise _fault(src, f"{where}.rays", "only a preset has rays")
    if "tor" in v:
        sizes = v["tor"]
        if not isinstance(sizes, list) or len(sizes) != 5:
            raise _fault(src, f"{where}.tor", f"expected the five sizes [NX, NY, NZ, ANGLES, OFFSETS], got {sizes!r}")
        sizes = tuple(_int(s, src, f"{where}.tor", 1) for s in sizes)
        width = v.get("width", 3.0)
        if isinstance(width, bool) or not isinstance(width, (int, float)) or not width > 0:
            raise _fault(src, f"{where}.width", f"expected a tube width > 0, got {width!r}")
        return MatrixSpec(tor=sizes, width=float(width))  # type: ignore[arg-type]
    if "width" in v:
        raise _fault(src, f"{where}.width", "only a tor matrix has a width")
    path = v["path"]
    if not isinstance(path, str) or not path:
        raise _fault(src, f"{where}.path", f"expected a file name, got {path!r}")
    p = Path(os.path.expandvars(os.path.expanduser(path)))
    return MatrixSpec(path=os.fspath(p if p.is_absolute() else base / p))


def parse_case(raw: Any, src: str, index: int, defaults: dict[str, Any], base: Path) -> Case:
    """One entry of ``cases`` (``defaults`` already checked for unknown keys)."""
    if not isinstance(raw, dict):
        raise _fault(src, f"cases[{index}]", f"expected a mapping, got {raw!r}")
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _fault(src, f"cases[{index}].name", f"expected a name of letters, digits, '_', '.', '-', got {name!r}")
    where = f"case {name}"
    unknown = sorted(set(raw) - set(CASE_KEYS))
    if unknown:
        raise _fault(src, f"{where}: {unknown[0]}", f"unknown key; expected some of {', '.join(CASE_KEYS)}")
    if "matrix" not in raw:
        raise _fault(src, f"{where}: matrix", "missing (a preset name, a path or {tor: [...]})")
    v = {**DEFAULTS, **defaults, **raw}
    matrix = parse_matrix(v["matrix"], src, f"{where}: matrix", base)
    fmt = _choice(v["format"], src, f"{where}: format", tuple(registry.FORMATS))
    backend = _choice(v["backend"], src, f"{where}: backend", BACKENDS)
    kernels = v["kernels"]
    if not isinstance(kernels, list) or not kernels:
        raise _fault(src, f"{where}: kernels", f"expected a list of FP/BP pairs, got {kernels!r}")
    pairs = tuple(parse_pair(k, src, f"{where}: kernels[{i}]", ) for i, k in enumerate(kernels))
    for i, (fp, bp) in enumerate(pairs):  # names of this backend that read this format (GPU counts: at run time)
        for key, name_ in (("fp", fp), ("bp", bp)):
            try:
                registry.check(key, name_, backend, fmt=fmt)
            except ConfigError as exc:
                raise _fault(src, f"{where}: kernels[{i}]", exc.fault) from None
    gpus = _int_list(v["gpus"], src, f"{where}: gpus", "GPU counts")
    if backend == "cpu" and gpus != (1,):
        raise _fault(src, f"{where}: gpus", f"the cpu backend runs on the host: gpus must be [1], got {list(gpus)}")
    voxel_order = _choice(v["voxel_order"], src, f"{where}: voxel_order", VOXEL_ORDERS)
    if voxel_order != "raster" and matrix.preset is None:
        raise _fault(src, f"{where}: voxel_order", "only a preset is generated in another voxel order")
    description = v["description"]
    if not isinstance(description, str):
        raise _fault(src, f"{where}: description", f"expected text, got {description!r}")
    layout = _choice(v["layout"], src, f"{where}: layout", LAYOUTS)
    subsets = _int_list(v["subsets"], src, f"{where}: subsets", "subset counts S >= 1")
    if max(subsets) > 1 and backend == "cuda" and layout != "local":
        raise _fault(src, f"{where}: subsets", f"OSEM subsets run in the local layout, not {layout!r} (its "
                                                 "correlation spans every row)")
    prior = _names(v["prior"], src, f"{where}: prior", PRIORS)
    threshold = parse_threshold(v["threshold"], src, f"{where}: threshold", prior, subsets)
    return Case(
        name=name,
        matrix=matrix,
        description=description,
        fold=_bool(v["fold"], src, f"{where}: fold"),
        voxel_order=voxel_order,
        order=_choice(v["order"], src, f"{where}: order", ORDERS),
        format=fmt,
        kernels=pairs,
        cusparse=_bool(v["cusparse"], src, f"{where}: cusparse"),
        gpus=gpus,
        backend=backend,
        layout=layout,
        graph=v["graph"] if v["graph"] == "auto" else _bool(v["graph"], src, f"{where}: graph (or auto)"),
        warmup=_int(v["warmup"], src, f"{where}: warmup", 0),
        iterations=_int(v["iterations"], src, f"{where}: iterations", 1),
        repeats=_int(v["repeats"], src, f"{where}: repeats", 1),
        seed=_int(v["seed"], src, f"{where}: seed", 0),
        subsets=subsets,
        factors=_names(v["factors"], src, f"{where}: factors", FACTORS),
        prior=prior,
        threshold=threshold,
        source=src,
    )


def parse_threshold(v: Any, src: str, where: str, prior: tuple[str, ...],
                    subsets: tuple[int, ...]) -> Threshold | None:
    """A case's ``threshold`` (None: none): a mapping of :data:`THRESHOLD_KEYS`, for a case with a prior, its
    subset halving possible for every S of the case."""
    from mlemlib.map import check_halving, check_halving_passes

    if v is None:
        return None
    if not isinstance(v, dict):
        raise _fault(src, where, f"expected a mapping of {', '.join(THRESHOLD_KEYS)}, got {v!r}")
    unknown = sorted(set(v) - set(THRESHOLD_KEYS))
    if unknown:
        raise _fault(src, f"{where}.{unknown[0]}", f"unknown key; expected some of {', '.join(THRESHOLD_KEYS)}")
    if prior == ("none",):
        raise _fault(src, where, "a time to threshold is MAP's: list a prior (rdp, rdp-fast)")
    counts = v.get("counts", Threshold.counts)
    if isinstance(counts, bool) or not isinstance(counts, (int, float)) or not counts >= 1:
        raise _fault(src, f"{where}.counts", f"expected a number of counts >= 1, got {counts!r}")
    try:
        halving = check_halving_passes(v.get("subset_halving", []))
        for s in subsets:
            check_halving(halving, s)
    except ConfigError as exc:
        raise _fault(src, f"{where}.subset_halving", exc.fault) from None
    return Threshold(counts=float(counts), passes=_int(v.get("passes", Threshold.passes), src, f"{where}.passes", 1),
                     converged_passes=_int(v.get("converged_passes", Threshold.converged_passes), src,
                                           f"{where}.converged_passes", 1),
                     subset_halving=halving, seed=_int(v.get("seed", Threshold.seed), src, f"{where}.seed", 0))


def parse_cases(doc: Any, source: str | os.PathLike = "<cases>", base: Path | None = None) -> list[Case]:
    """The cases of a parsed cases document (see the module docstring)."""
    src = os.fspath(source)
    base = Path(src).resolve().parent if base is None else base
    if not isinstance(doc, dict):
        raise ConfigError(src, f"expected a mapping with 'cases', got {type(doc).__name__}")
    unknown = sorted(set(doc) - {"defaults", "cases"})
    if unknown:
        raise _fault(src, unknown[0], "unknown top-level key; expected defaults and cases")
    defaults = doc.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise _fault(src, "defaults", f"expected a mapping, got {defaults!r}")
    bad = sorted(set(defaults) - set(DEFAULTS))
    if bad:
        raise _fault(src, f"defaults: {bad[0]}", f"unknown key; expected some of {', '.join(DEFAULTS)}")
    raw = doc.get("cases")
    if not isinstance(raw, list) or not raw:
        raise _fault(src, "cases", f"expected a non-empty list of cases, got {raw!r}")
    cases = [parse_case(c, src, i, defaults, base) for i, c in enumerate(raw)]
    seen: set[str] = set()
    for c in cases:
        if c.name in seen:
            raise _fault(src, f"case {c.name}: name", "used by two cases")
        seen.add(c.name)
    return cases


def load_cases(path: str | os.PathLike) -> list[Case]:
    """Read and check a cases file.

    Raises
    ------
    ConfigError
        One line naming the file, the case and the key at fault (also for YAML syntax).
    """
    import yaml

    src = os.fspath(path)
    try:
        text = Path(src).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(src, f"cannot read: {exc.strerror or exc}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f"line {mark.line + 1}: " if mark is not None else ""
        raise ConfigError(src, f"{at}not valid YAML: {getattr(exc, 'problem', None) or exc}") from None
    return parse_cases(doc, src)


def select(cases: list[Case], names: list[str] | None, source: str = "<cases>") -> list[Case]:
    """The cases named (all for None or empty), in the file's order; an unknown name is a ConfigError."""
    if not names:
        return list(cases)
    known = {c.name for c in cases}
    for n in names:
        if n not in known:
            raise ConfigError(source, f"--case {n}: no such case; known: {', '.join(c.name for c in cases)}")
    return [c for c in cases if c.name in names]
