"""The benchmark runner: every case x kernel pair x GPU count through the public API, into CSV and JSON.

For each case (:mod:`mlemlib.bench.cases`) its matrix is prepared (or found
prepared: :mod:`mlemlib.bench.prepare`); for each GPU count and kernel pair
a backend is built with :func:`mlemlib.backends.make_backend` and its
iterations timed as the backend reports them
(:func:`mlemlib.bench.timing.time_iterations`). One row per case, pair and
GPU count gives the median iteration time, the bytes the iteration must read
and their time at the copy bandwidth measured in the same run (its floor),
the same run's 1-GPU time of the pair and cuSPARSE's time on the same matrix
and GPU count, the device, date and command, and the matrix's facts.

A case with OSEM subsets or factors (:attr:`~mlemlib.bench.cases.Case.osem`)
is timed once per S and factor setting (:meth:`~mlemlib.bench.cases.Case.variants`):
for S > 1 on a matrix prepared with its rows grouped by subset, the backend
built with the subsets' bounds and update norms, one timed iteration being one
full pass over the S subsets; with ``synthetic`` factors with the background
``b' = b / m`` and m-weighted sensitivities (:mod:`mlemlib.bench.factors`).
Its rows carry S (``subsets``), ``factors``, the same run's S = 1 time of the
same configuration (``ms_mlem``, ``pass_vs_mlem``), its time without factors
(``ms_no_factors``, ``factors_vs_none``), and the step times the backend
reports (``steps_ms``; ``allreduce_ms`` and ``allreduce_share`` where it
all-reduces; where the iterations replay CUDA graphs, which hide the steps,
from as many more iterations of the same backend launched kernel by kernel:
``steps_from``, ``steps_iteration_ms``). Other cases' rows have none of these keys.

:func:`write_results` merges the rows into ``DIR/results.json`` and
``DIR/results.csv``: a row of the same case, pair, GPU count, device, S and
factors from an earlier run is replaced, the others are kept, so cases can be run one
command at a time into one directory.
"""

from __future__ import annotations

import csv
import datetime as _dt
import io
import json
import logging
import os
import platform
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mlemlib import registry
from mlemlib.bench.cases import CUSPARSE, Case, bench_settings, rdp_weights
from mlemlib.bench.factors import BenchProblem, bench_problem
from mlemlib.bench.prepare import DEFAULT_WORK, Prepared, matrix_facts, partition, prepare
from mlemlib.bench.timing import floor_bytes, host_copy_bandwidth, time_iterations
from mlemlib.errors import ConfigError, DeviceError, InputError

log = logging.getLogger(__name__)

RESULTS_VERSION = 1
#: Columns of ``results.csv`` (``results.json`` has the same rows, plus ``ms_repeats`` and ``describe``).
FIELDS = (
    "case", "description", "matrix", "order", "format", "folded", "m", "n", "nnz", "bytes_per_nnz",
    "backend", "fp", "bp", "fp_kernel", "bp_kernel", "deterministic", "gpus", "layout", "graph", "exchange",
    "warmup", "iterations", "repeats", "ms", "ms_min", "ms_max", "floor_bytes", "floor_ms", "of_floor",
    "copy_bandwidth", "ms_1gpu", "speedup", "cusparse_ms", "device", "device_kind", "date", "command",
    "commit", "error",
)
#: Columns of a case with subsets or factors (after :data:`FIELDS`, where a row has them).
OSEM_FIELDS = (
    "subsets", "factors", "prior", "ms_mlem", "pass_vs_mlem", "ms_no_factors", "factors_vs_none", "ms_no_prior",
    "prior_vs_none", "allreduce_ms", "allreduce_share",
)
#: Columns of a case with a time to threshold (after those, where a row has them; :mod:`mlemlib.bench.threshold`).
THRESHOLD_FIELDS = (
    "passes_to_threshold", "seconds_to_threshold", "threshold_pass_ms", "threshold_passes", "converged_passes",
    "threshold_halving", "threshold_beta", "threshold_epsilon", "threshold_error",
)
#: What identifies a row: a later run's row with the same values replaces it (S 1, factors and prior none where a
#: row has no such keys).
ROW_KEY = ("case", "fp", "bp", "gpus", "device_kind", "subsets", "factors", "prior")
_KEY_DEFAULTS = {"subsets": 1, "factors": "none", "prior": "none"}


def row_key(r: dict[str, Any]) -> tuple:
    """The row's :data:`ROW_KEY` values."""
    return tuple(r.get(k, _KEY_DEFAULTS.get(k)) for k in ROW_KEY)


def pair_label(fp: str, bp: str) -> str:
    """``fp/bp``, or one name where both are the same."""
    return fp if fp == bp else f"{fp}/{bp}"


def git_commit() -> str | None:
    """The commit of the code that runs: its git checkout's short commit (``+dirty`` with uncommitted changes);
    for a tree exported by ``git archive`` (no checkout of its own, or inside another checkout) the commit the
    archive recorded (:mod:`mlemlib._archive`); else None."""
    from mlemlib._archive import COMMIT

    here = Path(__file__).resolve().parent
    root = here.parent.parent  # the directory that holds the mlemlib package
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=here, capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        if Path(top).resolve() == root:
            rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                                 timeout=10, check=True).stdout.strip()
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                   capture_output=True, text=True, timeout=30).stdout.strip()
            return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return None if COMMIT.startswith("$") else COMMIT


class Devices:
    """The run's devices: names, and each one's copy bandwidth, measured once per run when first asked."""

    def __init__(self, kind: str | None = None, copy_bytes: int = 1 << 30) -> None:
        self.kind_override = kind
        self.copy_bytes = copy_bytes
        self._bw: dict[Any, dict[str, Any]] = {}
        self._gpu_count: int | None = None
        self._gpu_name: str | None = None

    def gpu_count(self) -> int:
        if self._gpu_count is None:
            from mlemlib.backends import cuda_available

            if not cuda_available():
                self._gpu_count = 0
            else:
                import cupy as cp

                self._gpu_count = int(cp.cuda.runtime.getDeviceCount())
        return self._gpu_count

    def name(self, backend: str) -> str:
        if backend == "cpu":
            return f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} threads)"
        if self._gpu_name is None:
            from mlemlib.devices import device_facts

            self._gpu_name = str(device_facts(0).get("name", "GPU"))
        return self._gpu_name

    def kind(self, backend: str) -> str:
        if self.kind_override:
            return self.kind_override
        if backend == "cpu":
            return f"cpu-{platform.node() or 'host'}"
        return f"{self.gpu_count()} x {self.name(backend)}"

    def bandwidth(self, backend: str, gpus: int) -> float:
        """Bytes/s of one device: the host's (cpu), else the median over GPUs ``0 .. gpus-1`` of each's copy bandwidth."""
        if backend == "cpu":
            if "cpu" not in self._bw:
                self._bw["cpu"] = host_copy_bandwidth()
                log.info("host copy bandwidth %.1f GB/s", self._bw["cpu"]["bandwidth"] / 1e9)
            return self._bw["cpu"]["bandwidth"]
        from mlemlib.devices import copy_bandwidth

        vals = []
        for i in range(gpus):
            if i not in self._bw:
                self._bw[i] = copy_bandwidth(self.copy_bytes, device=i)
                log.info("GPU %d: copy bandwidth %.3f TB/s", i, self._bw[i]["bandwidth"] / 1e12)
                _free_pools([i])
            vals.append(self._bw[i]["bandwidth"])
        vals.sort()
        return vals[len(vals) // 2]

    def measured(self) -> dict[str, Any]:
        return {str(k): v for k, v in self._bw.items()}


def _free_pools(devices: Sequence[int]) -> None:
    try:
        import cupy as cp
    except ImportError:
        return
    for d in devices:
        with cp.cuda.Device(d):
            cp.get_default_memory_pool().free_all_blocks()


def _close(src: Any) -> None:
    close = getattr(src, "close", None)
    if close is not None:
        close()


def _matrix_columns(case: Case, facts: dict[str, Any]) -> dict[str, Any]:
    m, n = facts["shape"]
    return {
        "case": case.name,
        "description": case.description,
        "matrix": case.matrix.label,
        "order": case.order,
        "format": case.format,
        "folded": bool(facts.get("folded")),
        "m": m,
        "n": n,
        "nnz": facts["nnz"],
        "bytes_per_nnz": round(facts["bytes_per_nnz"], 4) if facts.get("bytes_per_nnz") else None,
    }


def run_pair(case: Case, prep: Prepared, fp: str, bp: str, gpus: int, devices: Devices,
             problem: BenchProblem, transpose_bytes: int | None, factors: str = "none",
             prior: str = "none") -> dict[str, Any]:
    """One row: build the backend of ``fp``/``bp`` on ``gpus`` devices for ``problem`` (``g``, the norm, and the
    background and subsets where it has them), wrapped for MAP where ``prior`` is not ``none``
    (:func:`map_backend`), time its iterations, free it; ``factors`` and ``prior`` name the problem in the row
    of a case with subsets, factors or a prior."""
    from mlemlib.backends import graph_option, make_backend
    from mlemlib.formats import open_source

    row: dict[str, Any] = {"fp": fp, "bp": bp, "gpus": gpus, "layout": case.layout if gpus > 1 else None,
                           "warmup": case.warmup, "iterations": case.iterations, "repeats": case.repeats}
    if case.osem:
        row.update(subsets=prep.subsets, factors=factors, prior=prior)
    reference = (fp, bp) == CUSPARSE
    if reference and prep.csr is None:
        row["error"] = prep.facts.get("cusparse_refused", "no CSR copy of the matrix")
        return row
    g, norm = problem.g, problem.norm
    src = open_source(os.fspath(prep.csr if reference else prep.matrix), "matrix")
    tsrc = None
    be = None
    try:
        if registry.uses_transpose(case.backend, bp) and prep.transpose is not None:
            tsrc = open_source(os.fspath(prep.transpose), "transpose")
        kw: dict[str, Any] = {"fp": fp, "bp": bp, **problem.backend_options()}
        if case.backend == "cuda":
            kw.update(gpus=gpus, layout=case.layout)
            # the partition stage's plan (each GPU's A_k^T where it is needed); OSEM balances each subset itself
            if gpus > 1 and not reference and prep.subsets == 1:
                kw["plan"] = os.fspath(partition(case, prep, gpus))
        # None (auto, and the cpu backend's): the backend decides; the cuSPARSE reference pair cannot be captured
        graph = None if case.backend != "cuda" else False if reference else graph_option(case.graph)
        t0 = time.perf_counter()
        try:
            asked = {"graph": graph} if graph is not None else {}
            be = make_backend(case.backend, src, g, norm, tsrc, **kw, **asked)
        except ConfigError as exc:
            if not graph or "graph" not in str(exc):
                raise
            log.info("%s %s on %d device(s): no graph capture (%s)", case.name, pair_label(fp, bp), gpus, exc)
            graph = False
            be = make_backend(case.backend, src, g, norm, tsrc, **kw)
        if prior != "none":
            be = map_backend(be, src, prep, problem, prior)
        setup_s = time.perf_counter() - t0
        timed = time_iterations(be, warmup=case.warmup, iterations=case.iterations, repeats=case.repeats,
                                steps=case.osem)
        desc = be.describe()
        if case.osem and desc.get("graph", bool(graph)) and hasattr(be, "use_graph"):
            timed.update(_eager_steps(case, be))
        bw = devices.bandwidth(case.backend, gpus)
        nbytes = floor_bytes(desc, prep.facts, case.backend, getattr(be, "bp_kernel", None) or desc.get("bp"),
                             transpose_bytes)
        floor_ms = nbytes / (bw * gpus) * 1e3
        row.update(
            fp_kernel=getattr(be, "fp_kernel", None) or desc.get("fp"),
            bp_kernel=getattr(be, "bp_kernel", None) or desc.get("bp"),
            deterministic=bool(getattr(be, "deterministic", desc.get("deterministic"))),
            graph=bool(desc.get("graph", bool(graph))),
            exchange=desc.get("exchange"),  # how several GPUs sum the back projection (nccl, peer)
            **timed,
            floor_bytes=nbytes,
            floor_ms=floor_ms,
            of_floor=floor_ms / timed["ms"] if timed["ms"] > 0 else None,
            copy_bandwidth=bw,
            setup_s=round(setup_s, 3),
            describe=_jsonable(desc),
        )
        log.info("%s %s%s, %d device(s): %.3f ms per iteration (%s + %s), %.1f%% of its floor %.3f ms", case.name,
                 pair_label(fp, bp), _variant_label(row), gpus, timed["ms"], row["fp_kernel"], row["bp_kernel"],
                 100 * (row["of_floor"] or 0), floor_ms)
    except (ConfigError, DeviceError) as exc:
        row["error"] = str(exc)
        log.warning("%s %s%s on %d device(s) not run: %s", case.name, pair_label(fp, bp), _variant_label(row), gpus,
                    exc)
    except Exception as exc:  # noqa: BLE001 - out of memory, a CUDA fault: the other pairs still run
        row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
        log.exception("%s %s%s on %d device(s) failed", case.name, pair_label(fp, bp), _variant_label(row), gpus)
    finally:
        del be
        _close(src)
        if tsrc is not None:
            _close(tsrc)
        if case.backend == "cuda":
            _free_pools(range(gpus))
    return row


def map_backend(be: Any, src: Any, prep: Prepared, problem: BenchProblem, prior: str) -> Any:
    """``be`` running BSREM passes with ``prior`` (``rdp``) on the matrix's voxel grid (in its stored voxel order,
    ``voxel_perm.npy`` of a reordered case):
    ``gamma = 2``, ``beta`` by docs/reconstruction.md's rule ``c = beta * 19.1 / mean(s) = 0.25`` (``s`` the
    sensitivities, summed over the subsets) and ``epsilon`` 1e-3 of the initial image's value; ``rdp`` with the
    default settings, ``rdp-fast`` with :data:`mlemlib.bench.cases.FAST_MAP`'s; no objective per pass (it is not part of a pass's
    time)."""
    from mlemlib.map import MapBackend, MapSettings
    from mlemlib.prior import make_prior, require_grid

    norm = np.asarray(problem.norm, dtype=np.float64)
    s = np.nansum(norm.reshape(-1, norm.shape[-1]), axis=0)
    beta, epsilon = rdp_weights(s.mean(), s.sum(), np.sum(problem.g, dtype=np.float64))
    settings = MapSettings("rdp", beta=beta, gamma=2.0, epsilon=epsilon, **bench_settings(prior))
    kept = prep.directory / "voxel_perm.npy"
    grid_prior = make_prior(settings.prior, require_grid(src), beta=beta, gamma=2.0, epsilon=epsilon,
                            voxels=np.load(kept) if kept.exists() else None)
    return MapBackend(be, settings, grid_prior, norm)


def _eager_steps(case: Case, be: Any) -> dict[str, Any]:
    """The step times of iterations launched kernel by kernel (a replayed CUDA graph reports only the whole
    iteration): ``steps_ms``, the all-reduce's time and share of such an iteration, its time (``steps_iteration_ms``)."""
    be.use_graph(False)
    eager = time_iterations(be, warmup=1, iterations=case.iterations, repeats=1, steps=True)
    out = {"steps_ms": eager["steps_ms"], "steps_from": "kernel by kernel", "steps_iteration_ms": eager["ms"]}
    for key in ("allreduce_ms", "allreduce_share"):
        if key in eager:
            out[key] = eager[key]
    return out


def _variant_label(row: dict[str, Any]) -> str:
    """`` (S = 16, synthetic factors)`` for a row of a case with subsets or factors, else ``""``."""
    if "subsets" not in row:
        return ""
    return (f" (S = {row['subsets']}" + (f", {row['factors']} factors" if row.get("factors") != "none" else "")
            + (f", MAP {row['prior']}" if row.get("prior", "none") != "none" else "") + ")")


def _jsonable(v: Any) -> Any:
    return json.loads(json.dumps(v, default=lambda o: o.item() if hasattr(o, "item") else str(o)))


def fill_relations(rows: list[dict[str, Any]]) -> None:
    """Per row: the same run's 1-GPU time of the pair (``ms_1gpu``, ``speedup``) and cuSPARSE's time on the same
    case and GPU count (``cusparse_ms``); for a case with subsets or factors (its rows have ``subsets``) the S = 1
    time of the same pair, GPU count and factors (``ms_mlem``, ``pass_vs_mlem``, for S > 1) and the time of the
    same pair, GPU count and S without factors (``ms_no_factors``, ``factors_vs_none``, for synthetic factors)
    and without the prior (``ms_no_prior``, ``prior_vs_none``: a MAP pass over an OSEM pass). Rows are related
    only within one case, device and date, and the first two within one S, factor setting and prior."""
    def key(r: dict[str, Any]) -> tuple:
        return r["case"], r.get("device_kind"), r.get("date"), r.get("command")

    def find(r: dict[str, Any], **want: Any) -> dict[str, Any] | None:
        return next((o for o in rows if key(o) == key(r) and o.get("ms")
                     and all(o.get(k, _KEY_DEFAULTS.get(k)) == v for k, v in want.items())), None)

    for r in rows:
        if r.get("ms") is None:
            continue
        s, f, p = r.get("subsets", 1), r.get("factors", "none"), r.get("prior", "none")
        one = find(r, fp=r["fp"], bp=r["bp"], gpus=1, subsets=s, factors=f, prior=p)
        if one is not None and r["gpus"] > 1:
            r["ms_1gpu"] = one["ms"]
            r["speedup"] = one["ms"] / r["ms"]
        ref = find(r, fp=CUSPARSE[0], bp=CUSPARSE[1], gpus=r["gpus"], subsets=s, factors=f, prior=p)
        if ref is not None:
            r["cusparse_ms"] = ref["ms"]
        if "subsets" not in r:
            continue
        same = {"fp": r["fp"], "bp": r["bp"], "gpus": r["gpus"]}
        mlem = find(r, **same, subsets=1, factors=f, prior=p) if s > 1 else None
        if mlem is not None:
            r["ms_mlem"] = mlem["ms"]
            r["pass_vs_mlem"] = r["ms"] / mlem["ms"]
        plain = find(r, **same, subsets=s, factors="none", prior=p) if f != "none" else None
        if plain is not None:
            r["ms_no_factors"] = plain["ms"]
            r["factors_vs_none"] = r["ms"] / plain["ms"]
        osem = find(r, **same, subsets=s, factors=f, prior="none") if p != "none" else None
        if osem is not None:
            r["ms_no_prior"] = osem["ms"]
            r["prior_vs_none"] = r["ms"] / osem["ms"]


def run_case(case: Case, devices: Devices, *, work: str | os.PathLike = DEFAULT_WORK, gpus: Sequence[int] | None = None,
             threads: int | None = None, command: str = "", commit: str | None = None) -> list[dict[str, Any]]:
    """The rows of one case (its matrix prepared first); GPU counts limited to ``gpus`` where given."""
    counts = [k for k in case.gpus if gpus is None or k in gpus]
    if not counts:
        log.info("%s: none of its GPU counts %s in --gpus %s", case.name, list(case.gpus), list(gpus or []))
        return []
    if case.backend == "cuda":
        have = devices.gpu_count()
        if have == 0:
            raise DeviceError(f"case {case.name} runs on the cuda backend, and CuPy sees no GPU here")
        skipped = [k for k in counts if k > have]
        if skipped:
            log.warning("%s: %d GPU(s) visible, GPU counts %s skipped", case.name, have, skipped)
        counts = [k for k in counts if k <= have]
    date = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
    rows = []
    for subsets in sorted(case.subsets):
        t0 = time.perf_counter()
        prep = prepare(case, work, threads=threads, subsets=subsets)
        log.info("%s: matrix%s ready in %.1f s: %s", case.name, f" of {subsets} subsets" if subsets > 1 else "",
                 time.perf_counter() - t0, prep.matrix)
        transpose_bytes = matrix_facts(prep.transpose)["bytes"] if prep.transpose is not None else None
        base = _matrix_columns(case, prep.facts)
        for factors in [f for s_, f in case.variants() if s_ == subsets]:
            problem = bench_problem(prep, factors, case.seed)
            for k in counts:
                for prior in case.prior:
                    for fp, bp in case.pairs(subsets, factors, prior):
                        row = {**base, "backend": case.backend,
                               **run_pair(case, prep, fp, bp, k, devices, problem, transpose_bytes, factors, prior)}
                        row.update(device=devices.name(case.backend), device_kind=devices.kind(case.backend),
                                   date=date, command=command, commit=commit)
                        if case.threshold is not None and prior != "none" and not row.get("error"):
                            row.update(_threshold(case, prep, prior, k))
                        rows.append(row)
            del problem
    fill_relations(rows)
    return rows


def _threshold(case: Case, prep: Prepared, prior: str, gpus: int) -> dict[str, Any]:
    """A MAP row's time to threshold (:func:`mlemlib.bench.threshold.measure`), or ``threshold_error``."""
    from mlemlib.bench.threshold import measure

    try:
        return measure(case, prep, prior, gpus)
    except (ConfigError, DeviceError, InputError) as exc:
        log.warning("%s, %s on %d device(s): no time to threshold: %s", case.name, prior, gpus, exc)
        return {"threshold_error": str(exc)}
    finally:
        if case.backend == "cuda":
            _free_pools(range(gpus))


def prepare_case(case: Case, work: str | os.PathLike = DEFAULT_WORK, *, threads: int | None = None) -> list[Prepared]:
    """Everything ``case`` needs before it is timed: its matrix for each S (:func:`~mlemlib.bench.prepare.prepare`),
    the synthetic factors where it lists them (:func:`~mlemlib.bench.factors.bench_problem`) and, with a
    ``threshold``, the simulated measurement (:func:`mlemlib.bench.threshold.simulated`; the converged image is
    made on the case's backend when it first runs)."""
    from mlemlib.bench.threshold import simulated

    out = []
    for subsets in sorted(case.subsets):
        prep = prepare(case, work, threads=threads, subsets=subsets)
        if "synthetic" in case.factors:
            bench_problem(prep, "synthetic", case.seed)
        if case.threshold is not None:
            simulated(prep.matrix, prep.directory, case.threshold)
        out.append(prep)
    return out


def run_cases(cases: Sequence[Case], out: str | os.PathLike, *, work: str | os.PathLike = DEFAULT_WORK,
              gpus: Sequence[int] | None = None, threads: int | None = None, command: str = "",
              device_kind: str | None = None, copy_bytes: int = 1 << 30) -> list[dict[str, Any]]:
    """Run ``cases`` and merge their rows into ``out/results.json`` and ``out/results.csv``; return this run's rows."""
    devices = Devices(device_kind, copy_bytes)
    commit = git_commit()
    rows: list[dict[str, Any]] = []
    for case in cases:
        rows += run_case(case, devices, work=work, gpus=gpus, threads=threads, command=command, commit=commit)
        write_results(out, rows, copy=devices.measured())  # after each case: a later fault keeps what was measured
    return rows


def read_results(directory: str | os.PathLike) -> dict[str, Any]:
    """``directory/results.json`` (``{"version", "rows", "runs"}``); empty where there is none.

    Raises
    ------
    ConfigError
        A file that is not a results file.
    """
    path = Path(directory) / "results.json"
    if not path.exists():
        return {"version": RESULTS_VERSION, "rows": [], "runs": []}
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(os.fspath(path), f"not a results file: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
        raise ConfigError(os.fspath(path), "not a results file: no list 'rows'")
    doc.setdefault("runs", [])
    return doc


def merge_rows(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``old`` with every row of the same :data:`ROW_KEY` as a row of ``new`` replaced, then ``new``'s others."""
    keys = {row_key(r) for r in new}
    return [r for r in old if row_key(r) not in keys] + list(new)


def format_csv(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as CSV (:data:`FIELDS`, then :data:`OSEM_FIELDS` where a row has S and :data:`THRESHOLD_FIELDS`
    where one has a time to threshold; floats as Python writes them)."""
    from mlemlib.bench.threshold import has_threshold

    fields = (FIELDS + (OSEM_FIELDS if any("subsets" in r for r in rows) else ())
              + (THRESHOLD_FIELDS if any(has_threshold(r) for r in rows) else ()))
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: r.get(k) for k in fields})
    return buf.getvalue()


def write_results(directory: str | os.PathLike, rows: list[dict[str, Any]], *, copy: dict[str, Any] | None = None,
                  replace: bool = False) -> dict[str, Any]:
    """Merge ``rows`` into ``directory/results.json`` and rewrite ``results.csv`` from it (both atomically)."""
    from mlemlib._io import atomic_path

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    doc = {"version": RESULTS_VERSION, "rows": [], "runs": []} if replace else read_results(d)
    doc["rows"] = merge_rows(doc["rows"], rows)
    run = {"date": rows[0].get("date") if rows else None, "command": rows[0].get("command") if rows else None,
           "copy_bandwidth": copy or {}}
    doc["runs"] = [r for r in doc["runs"] if (r.get("date"), r.get("command")) != (run["date"], run["command"])]
    doc["runs"].append(run)
    doc["version"] = RESULTS_VERSION
    for name, text in (("results.json", json.dumps(doc, indent=1, default=str) + "\n"),
                       ("results.csv", format_csv(doc["rows"]))):
        with atomic_path(d / name) as tmp:
            Path(tmp).write_text(text, encoding="utf-8")
    return doc
