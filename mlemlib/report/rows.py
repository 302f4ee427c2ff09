"""The records a summary is made of: runs' timings loaded into rows, grouped, compared (host; pure Python, NumPy).

:func:`load_timings` reads the ``timings.json`` of runs (and of the float64
references); :func:`run_rows` makes one row per run and repetition (the rows
of ``runs.csv``, :data:`RUN_COLUMNS`), :func:`group_rows` groups them by
configuration and :func:`config_label` names a configuration (a MAP run's
algorithm, prior and beta included, :func:`map_columns`; its time to threshold,
:func:`map_threshold`). From the rows:
:func:`scaling_table` (speed-up over GPU counts and layouts),
:func:`thesis_table` (the thesis's run beside ours) and
:func:`transpose_rows` (transposition times from ``transpose.h5`` files and
Snakemake benchmark files). :mod:`mlemlib.report.tables` renders these as
CSV and Markdown, :mod:`mlemlib.report.plots` as figures.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from mlemlib.errors import InputError
from mlemlib.map import DEFAULT_RELAXATION, MapSettings
from mlemlib.mlem import transpose_used

log = logging.getLogger(__name__)

#: Steps reported in the tables, in order (``map``: a MAP run's prior gradient and step, timed on the host).
STEPS = ("fp", "corr", "bp", "update", "map", "allreduce")

#: The fixed columns of ``runs.csv`` (``cr_<label>`` columns follow).
RUN_COLUMNS = (
    "run", "matrix", "data", "backend", "fp", "bp", "transpose", "secsize", "gpus", "layout", "graph", "steps_from",
    "dtype",
    "reference_mode", "subsets", "subset_method", "m", "b", "map_algorithm", "prior", "beta", "iterations", "repetition", "deterministic", "device", "format", "bytes_per_nnz",
    "iteration_mean_s", "iteration_median_s", "iteration_min_s", "iteration_max_s", "iteration_std_s",
    *(f"{s}_{k}_s" for s in STEPS for k in ("mean", "median", "min", "max")),
    "load_s", "setup_s", "wall_s", "bytes_per_iteration", "bandwidth_GBps", "fp_bandwidth_GBps",
    "bp_bandwidth_GBps", "gpu_bandwidth_theoretical_GBps", "gpu_bandwidth_measured_GBps",
    "of_floor", "of_csr_floor", "energy_J", "energy_per_iteration_J", "power_W", "energy_gpus",
    "power_capped_s", "thermal_capped_s",
    "phi", "time_to_threshold_s", "passes_to_threshold",
    "image_sum", "reference_sum", "rel_l2_reference", "sum_rel_error_reference", "rel_l2_truth", "image_sha256", "resumed_at",
)

_TRANSPOSE_METHODS = ("scantrans", "scipy", "cusparse")



# --------------------------------------------------------------------------- loading
def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            d = json.load(fh)
    except FileNotFoundError:
        raise InputError(path, "no such file") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(path, f"not a readable JSON file ({exc})") from None
    if not isinstance(d, dict) or "repetitions" not in d or "config" not in d:
        raise InputError(path, "not a timings.json written by mlem reconstruct (no 'config'/'repetitions')")
    return d


def load_timings(items: Iterable[Any]) -> list[tuple[str, dict[str, Any]]]:
    """Collect ``(run id, timings)`` pairs.

    Parameters
    ----------
    items
        ``timings.json`` paths, run directories (searched recursively for
        ``timings.json``) or already-loaded timings dicts.

    Raises
    ------
    InputError
        A path that does not exist or a file that is not a timings record.
    """
    out: list[tuple[str, dict[str, Any]]] = []
    for k, item in enumerate(items):
        if isinstance(item, Mapping):
            if "repetitions" not in item or "config" not in item:
                raise InputError(f"<timings {k}>", "not a timings record (no 'config'/'repetitions')")
            out.append((str(item.get("run", f"run{k}")), dict(item)))
            continue
        p = Path(item)
        if p.is_dir():
            found = sorted(p.rglob("timings.json"))
            if not found:
                log.warning("%s: no timings.json below this directory", p)
            out += [(os.fspath(f.parent), _read_json(f)) for f in found]
        elif p.exists():
            out.append((os.fspath(p.parent), _read_json(p)))
        else:
            raise InputError(p, "no such file or directory")
    return out




# --------------------------------------------------------------------------- accuracy join
def join_reference_accuracy(
    timings: list[tuple[str, dict[str, Any]]], reference_images: Iterable[Any]
) -> list[tuple[str, dict[str, Any]]]:
    """The runs' accuracy against the float64 reference, joined where the summary is made.

    A run does not wait for its reference (the workflow's ``run_mlem`` has no
    reference input); here each run's final image (``image.h5``, named in its
    ``timings.json``) is compared with the reference image of the same
    problem and iteration count (their ``problem`` fingerprint and
    ``iterations`` attributes), with :func:`mlemlib.metrics.accuracy`: the
    same ``reference_sum``, ``rel_l2_reference`` and
    ``sum_rel_error_reference`` a run given ``reference=`` records. Every
    repetition gets all three: the final image's (the same ``image_sha256``;
    all of them in a deterministic run), or, for a repetition with another
    image (atomics), that image's, which ``image.h5`` keeps under
    ``/repetitions`` (:func:`mlemlib.image.read_repetition_images`); where it
    does not (a run resumed past that repetition, or written before they were
    kept) the sums from its recorded ``image_sum`` and no ``rel_l2_reference``.
    Runs that recorded their reference accuracy already, and references
    themselves, are left as they are.

    Parameters
    ----------
    timings
        ``(run id, timings)`` pairs of :func:`load_timings` (updated in place).
    reference_images
        ``image.h5`` files of float64 references (``mlem reconstruct --reference-mode``).

    Returns
    -------
    list
        ``timings``.

    Raises
    ------
    InputError
        A reference or run image that cannot be read.
    """
    from mlemlib import metrics
    from mlemlib.image import read_image, read_repetition_images

    refs: dict[tuple[str, int], tuple[str, np.ndarray]] = {}
    for path in reference_images:
        img, attrs = read_image(path)
        if attrs.get("problem") is None or attrs.get("iterations") is None:
            raise InputError(path, "no 'problem'/'iterations' attributes (not a reference image written by mlem)")
        refs[(str(attrs["problem"]), int(attrs["iterations"]))] = (os.fspath(path), img)
    if not refs:
        return timings
    for run_id, t in timings:
        cfg = t.get("config") or {}
        key = (str(t.get("problem")), int(cfg.get("iterations") or -1))
        if cfg.get("reference_mode") or key not in refs:
            continue
        reps = t.get("repetitions") or []
        if all("rel_l2_reference" in (rep.get("accuracy") or {}) for rep in reps):
            continue
        ref_path, ref = refs[key]
        image = run_image({"run": run_id, "_outputs": t.get("outputs", {})})
        if image is None:
            log.warning("%s: names no image; no accuracy against %s", run_id, ref_path)
            continue
        final, _ = read_image(image, expected_length=ref.size)
        joined = metrics.accuracy(final, reference=ref)
        digest = joined["image_sha256"]
        others = read_repetition_images(image)
        for rep in reps:
            acc = rep.setdefault("accuracy", {})
            sha = acc.get("image_sha256", digest)
            if sha == digest or sha in others:
                own = joined if sha == digest else metrics.accuracy(others[sha], reference=ref)
                acc.update((k, own[k]) for k in ("reference_sum", "rel_l2_reference", "sum_rel_error_reference"))
            elif acc.get("image_sum") is not None:
                acc["reference_sum"] = joined["reference_sum"]
                acc["sum_rel_error_reference"] = metrics.relative_sum_error([acc["image_sum"]], [joined["reference_sum"]])
        cfg["reference"] = ref_path
    return timings



# --------------------------------------------------------------------------- rows
def _num(v: Any) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _device_name(t: dict[str, Any]) -> str:
    dev = t.get("device")
    if isinstance(dev, list):
        names = [d.get("name", "?") if isinstance(d, dict) else str(d) for d in dev]
        return f"{len(names)}x {names[0]}" if names else ""
    if isinstance(dev, dict):
        return str(dev.get("name", ""))
    return str(dev or "")


def run_gpus(t: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The device dicts of the GPUs of a cuda run (the backend's ``device`` or ``devices``); empty for the CPU."""
    if _family((t.get("config") or {}).get("backend")) != "cuda":
        return []
    be = t.get("backend") if isinstance(t.get("backend"), dict) else {}
    devs = next((d for d in (be.get("devices"), be.get("device"), t.get("device")) if d), None)
    if isinstance(devs, dict):
        devs = [devs]
    return [d for d in devs or [] if isinstance(d, dict)]


def _copy_bandwidth(d: Mapping[str, Any]) -> float | None:
    cb = d.get("copy_bandwidth")
    return _num(cb.get("bandwidth")) if isinstance(cb, dict) else _num(cb)


def gpu_bandwidth_sum(devs: list[dict[str, Any]], gpus: Any, key: str) -> float | None:
    """Bytes/s of all the run's GPUs: ``theoretical_bandwidth`` or the measured ``copy_bandwidth`` (``key``).

    The sum over the GPUs, as the mean of the known ones times the run's GPU
    count ``gpus``: the same where every GPU is recorded, and the estimate for
    a run under the one-GPU-per-process launcher, whose ``timings.json``
    (rank 0's) records only its own GPU. None where no GPU has the figure.
    """
    get = _copy_bandwidth if key == "copy_bandwidth" else (lambda d: _num(d.get(key)))
    vals = [v for v in (get(d) for d in devs) if v is not None]
    if not vals:
        return None
    count = int(_num(gpus) or len(devs))
    return float(np.mean(vals)) * max(count, len(devs))


def csr_pair_bytes(shape: Any, nnz: Any) -> int | None:
    """Bytes of ``A`` and ``A^T`` as CSR, read once each: what an iteration on the CSR pair must move."""
    try:
        m, n = (int(v) for v in shape)
        k = int(nnz)
    except (TypeError, ValueError):
        return None
    return 8 * (m + 1) + 8 * k + 8 * (n + 1) + 8 * k


def floor_fractions(t: Mapping[str, Any], seconds: Any, copy_bandwidth: Any) -> tuple[float | None, float | None]:
    """Fractions of the run's own floor and of the CSR floor, at the copy bandwidth measured in the run.

    Own floor: the bytes an iteration reads (``timings["bytes"]["iteration"]``,
    in the format on the device) over the GPUs' measured copy bandwidth; CSR
    floor: :func:`csr_pair_bytes` over the same. Each is the floor's time
    over the iteration's mean time (1: at the floor; a CSR-floor fraction
    above 1 is faster than any iteration that reads the CSR pair can be).
    None where the run measured no copy bandwidth (the CPU).
    """
    sec, bw = _num(seconds), _num(copy_bandwidth)
    if not sec or not bw:
        return None, None
    own = _num((t.get("bytes") or {}).get("iteration"))
    csr = csr_pair_bytes(t.get("shape"), t.get("nnz"))
    return (own / bw / sec if own else None), (csr / bw / sec if csr else None)


def run_rows(timings: Iterable[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per run and repetition (the rows of ``runs.csv``)."""
    rows = []
    for run_id, t in timings:
        cfg = t.get("config", {})
        be = t.get("backend", {}) if isinstance(t.get("backend"), dict) else {}
        nbytes = t.get("bytes", {}) or {}
        setup = t.get("setup", {}) or {}
        devs = run_gpus(t)
        theo = gpu_bandwidth_sum(devs, cfg.get("gpus"), "theoretical_bandwidth")
        measured = gpu_bandwidth_sum(devs, cfg.get("gpus"), "copy_bandwidth")
        bpn = be.get("bytes_per_nnz")
        # a run that replayed CUDA graphs timed its steps over iterations launched kernel by kernel after it
        kbk = next((r["steps_kernel_by_kernel"] for r in t.get("repetitions", []) if r.get("steps_kernel_by_kernel")),
                   None)
        for rep in t.get("repetitions", []):
            steps = rep.get("steps", {})
            steps_from = None
            if kbk and not any(s in steps for s in STEPS):
                steps, steps_from = {**kbk, "iteration": steps.get("iteration", {})}, "kernel by kernel"
            acc = rep.get("accuracy", {}) or {}
            row: dict[str, Any] = {
                "run": run_id,
                "matrix": cfg.get("matrix"),
                "data": cfg.get("data"),
                "backend": cfg.get("backend"),
                "fp": cfg.get("fp"),
                "bp": cfg.get("bp"),
                "transpose": transpose_used(be.get("transpose"), cfg.get("transpose") is not None),
                "secsize": cfg.get("secsize"),
                "gpus": cfg.get("gpus"),
                "layout": cfg.get("layout"),
                # Graph capture: the run's config, or (as mlem reconstruct records it) the backend's describe().
                "graph": bool(cfg.get("graph", be.get("graph", False))),
                "steps_from": steps_from,
                "dtype": cfg.get("dtype"),
                "reference_mode": bool(cfg.get("reference_mode", False)),
                **model_columns(cfg),
                **map_columns(t),
                "iterations": cfg.get("iterations", rep.get("iterations")),
                "repetition": rep.get("repetition"),
                "deterministic": bool(t.get("deterministic", be.get("deterministic", True))),
                "device": _device_name(t),
                "format": be.get("format"),
                "bytes_per_nnz": _num(bpn.get("A")) if isinstance(bpn, dict) else _num(bpn),
                "load_s": _num(setup.get("load_s")),
                "setup_s": _num(setup.get("backend_s")),
                "wall_s": _num(rep.get("wall_s")),
                "bytes_per_iteration": nbytes.get("iteration"),
                "image_sum": _num(acc.get("image_sum")),
                "reference_sum": _num(acc.get("reference_sum")),
                "rel_l2_reference": _num(acc.get("rel_l2_reference")),
                "sum_rel_error_reference": _num(acc.get("sum_rel_error_reference")),
                "rel_l2_truth": _num(acc.get("rel_l2_truth")),
                "image_sha256": acc.get("image_sha256"),
                "resumed_at": " ".join(str(v) for v in rep.get("resumed_at") or []) or None,
            }
            it = steps.get("iteration", {})
            for k in ("mean", "median", "min", "max", "std"):
                row[f"iteration_{k}_s"] = _num(it.get(k))
            for s in STEPS:
                st = steps.get(s, {})
                for k in ("mean", "median", "min", "max"):
                    row[f"{s}_{k}_s"] = _num(st.get(k))

            def bw(b: Any, sec: Any) -> float | None:
                b, sec = _num(b), _num(sec)
                return b / sec / 1e9 if b and sec else None

            row["bandwidth_GBps"] = bw(nbytes.get("iteration"), row["iteration_mean_s"])
            row["fp_bandwidth_GBps"] = bw(nbytes.get("fp"), row["fp_mean_s"])
            row["bp_bandwidth_GBps"] = bw(nbytes.get("bp"), row["bp_mean_s"])
            row["gpu_bandwidth_theoretical_GBps"] = theo / 1e9 if theo is not None else None
            row["gpu_bandwidth_measured_GBps"] = measured / 1e9 if measured is not None else None
            row["of_floor"], row["of_csr_floor"] = floor_fractions(t, row["iteration_mean_s"], measured)
            # NVML's counter advances in steps: a loop shorter than one reads 0 J, which is no measurement
            measured_energy = (_num(rep.get("energy_J")) or 0.0) > 0
            for k in ("energy_J", "energy_per_iteration_J", "power_W"):
                row[k] = _num(rep.get(k)) if measured_energy else None
            row["energy_gpus"] = rep.get("energy_gpus") if row["energy_J"] is not None else None
            capped = rep.get("clock_capped_s") or {}  # the loop's seconds of clocks held down (devices.EnergyMeter)
            row["power_capped_s"], row["thermal_capped_s"] = _num(capped.get("power")), _num(capped.get("thermal"))
            for label, v in (acc.get("contrast_recovery") or {}).items():
                row[f"cr_{label}"] = _num(v)
            row["_samples"] = rep.get("samples", {})
            row["_map"] = t.get("map") if isinstance(t.get("map"), dict) else None
            reached = map_threshold(row["_map"], rep)
            row["time_to_threshold_s"] = reached["seconds"] if reached else None
            row["passes_to_threshold"] = reached["passes"] if reached else None
            row["_outputs"] = t.get("outputs", {})
            row["_truth"] = cfg.get("truth")
            # The kernels as configured ("auto", "notrans" resolve per backend and GPU count).
            row["_fp_requested"] = cfg.get("fp_requested") or cfg.get("fp")
            row["_bp_requested"] = cfg.get("bp_requested") or cfg.get("bp")
            # graphs as configured ("auto" replays them on several GPUs only): one configuration across GPU counts
            row["_graph_requested"] = cfg.get("graph_requested")
            row["_shape"] = tuple(int(v) for v in t["shape"]) if isinstance(t.get("shape"), (list, tuple)) else None
            # A folded matrix (each distinct row once): the user's shape, and the rows it stores.
            fold = t.get("fold") if isinstance(t.get("fold"), dict) else None
            row["_stored_rows"] = row["_shape"][0] if fold and row["_shape"] else None
            if fold and row["_shape"]:
                row["_shape"] = (int(fold["user_rows"]), row["_shape"][1])
            row["_gpu_model"] = str(devs[0].get("name", "")) if devs else ""
            per_gpu = _mean(d.get("theoretical_bandwidth") for d in devs)
            row["_gpu_theoretical_GBps"] = per_gpu / 1e9 if per_gpu else None
            rows.append(row)
    return rows



def run_columns(rows: list[dict[str, Any]]) -> list[str]:
    """The columns of ``runs.csv``: :data:`RUN_COLUMNS`, then a ``cr_<label>`` column per contrast recovery insert."""
    extra = sorted({k for r in rows for k in r if k.startswith("cr_")})
    return list(RUN_COLUMNS) + extra


def model_columns(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What a run models beyond MLEM, from its ``timings.json`` config: ``subsets`` (S; 1 is MLEM),
    ``subset_method`` (``angle``, ``index``, ``file``; empty for MLEM), and ``m`` and ``b``: the first 8 hex
    digits of the checksum of the multiplicative factors and of the additive background it read, ``no`` where
    it read none (m = 1, b = 0)."""
    return {
        "subsets": int(cfg.get("subsets") or 1),
        "subset_method": cfg.get("subset_method") or None,
        "m": str(cfg.get("multiplicative_checksum") or "")[:8] or "no",
        "b": str(cfg.get("additive_checksum") or "")[:8] or "no",
    }


#: The MAP settings a run's ``_map_params`` holds (JSON each), besides its algorithm, prior and beta.
_MAP_PARAMS = ("gamma", "epsilon", "kappa", "relaxation", "preconditioner", "preconditioner_offset", "averaging",
               "subset_halving")
#: What a run recorded before a setting existed did (the setting's default).
_MAP_DEFAULTS = {"averaging": MapSettings.averaging, "subset_halving": list(MapSettings.subset_halving)}


def map_columns(t: Mapping[str, Any]) -> dict[str, Any]:
    """A MAP run's columns from its ``timings.json``'s ``map``: ``map_algorithm`` (``bsrem``, ``osl``), ``prior``
    (``rdp``, ``quadratic``), ``beta`` and ``phi`` (Phi after the last pass); None for MLEM and OSEM. The other
    settings (gamma, epsilon, kappa, relaxation, preconditioner and its offset, averaging) go into ``_map_params``,
    which tells configurations apart (a run recorded before ``averaging`` or ``subset_halving`` existed gave
    its last sub-iterate, every subset in every pass)."""
    m = t.get("map") if isinstance(t.get("map"), dict) else None
    if m is None:
        return {"map_algorithm": None, "prior": None, "beta": None, "phi": None, "_map_params": None}
    history = m.get("history") or []
    params = tuple(json.dumps(m.get(k, _MAP_DEFAULTS.get(k)), sort_keys=True) for k in _MAP_PARAMS)
    return {"map_algorithm": m.get("algorithm"), "prior": m.get("prior"), "beta": _num(m.get("beta")),
            "phi": _num(history[-1].get("phi")) if history and isinstance(history[-1], dict) else None,
            "_map_params": params}


def map_threshold(record: Mapping[str, Any] | None, rep: Mapping[str, Any]) -> dict[str, Any] | None:
    """:func:`mlemlib.map_metrics.time_to_threshold` of a repetition whose passes were measured (``map.metrics``
    of its ``timings.json``, with that repetition's iteration times), None otherwise (never reached, or not
    measured)."""
    from mlemlib.map_metrics import series, time_to_threshold

    metrics = (record or {}).get("metrics")
    if not isinstance(metrics, dict) or metrics.get("repetition", 0) != rep.get("repetition"):
        return None
    seconds = (rep.get("samples") or {}).get("iteration") or []
    try:
        return time_to_threshold(series(metrics), seconds)
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        log.warning("MAP metrics unreadable (%s): no time to threshold", exc)
        return None


def has_map_metrics(r: Mapping[str, Any]) -> bool:
    """Whether a row's run recorded MAP convergence metrics (``map.metrics`` with passes)."""
    return bool(((r.get("_map") or {}).get("metrics") or {}).get("passes"))


# --------------------------------------------------------------------------- grouping
_CONFIG_KEYS = ("matrix", "data", "backend", "fp", "bp", "transpose", "secsize", "graph", "gpus", "layout", "dtype",
                "reference_mode", "subsets", "m", "b", "map_algorithm", "prior", "beta", "_map_params")


def map_label(r: Mapping[str, Any]) -> str:
    """`` BSREM rdp beta=0.3`` for a MAP run, ``""`` otherwise; BSREM's settings where they are not the defaults
    follow: `` hessian`` (the preconditioner), `` offset=0.35``, `` relax=1,20``, `` mean`` (each pass's image
    the mean of its sub-iterates) and `` halve=10,20`` (the passes after which its subsets halve)."""
    if not r.get("map_algorithm"):
        return ""
    beta = _num(r.get("beta"))
    s = f" {str(r['map_algorithm']).upper()} {r.get('prior')}" + (f" beta={beta:g}" if beta is not None else "")
    params = r.get("_map_params")
    if not params or len(params) != len(_MAP_PARAMS):
        return s
    v = {k: json.loads(p) for k, p in zip(_MAP_PARAMS, params)}
    if v["preconditioner"] not in (None, MapSettings.preconditioner):
        s += f" {v['preconditioner']}"
    if _num(v["preconditioner_offset"]):
        s += f" offset={_num(v['preconditioner_offset']):g}"
    relax = v["relaxation"]
    if isinstance(relax, list) and len(relax) == 2 and [_num(x) for x in relax] != list(DEFAULT_RELAXATION):
        s += f" relax={_num(relax[0]):g},{_num(relax[1]):g}"
    if v["averaging"] == "pass":
        s += " mean"
    if v["subset_halving"]:
        s += " halve=" + ",".join(str(p) for p in v["subset_halving"])
    return s


def model_label(r: Mapping[str, Any]) -> str:
    """`` OSEM S8 +m +b`` for a run that models more than MLEM (``""`` for MLEM with m = 1, b = 0); a MAP run
    names its algorithm, prior and beta instead of OSEM (`` BSREM rdp beta=0.3 S8 +m +b``)."""
    subsets = (r.get("subsets") or 1) > 1
    if r.get("map_algorithm"):
        s = map_label(r) + (f" S{r['subsets']}" if subsets else "")
    else:
        s = f" OSEM S{r['subsets']}" if subsets else ""
    s += " +m" if r.get("m") not in (None, "no") else ""
    s += " +b" if r.get("b") not in (None, "no") else ""
    return s


def kernel_label(r: Mapping[str, Any]) -> str:
    """The kernels a run used, as chosen, and which of them ``auto`` chose: ``numba/numba+AT (auto)``.

    ``fp/bp`` are the kernels that ran (``+AT``: the back projection read a
    stored transpose ``A^T``; ``notrans`` never does). Where the run's
    configuration asked for ``auto`` (the ``fp_requested``/``bp_requested``
    of its ``timings.json``), the label says so: `` (auto)`` where both were,
    `` (fp auto)`` or `` (bp auto)`` where one was.
    """
    bp = f"{r.get('bp')}" + ("+AT" if r.get("transpose") and r.get("bp") != "notrans" else "")
    auto = [k for k in ("fp", "bp") if r.get(f"_{k}_requested") == "auto" and r.get(k) != "auto"]
    mark = " (auto)" if len(auto) == 2 else (f" ({auto[0]} auto)" if auto else "")
    return f"{r.get('fp')}/{bp}{mark}"


def config_label(r: Mapping[str, Any], *, gpus: bool = True) -> str:
    """The one name of a run's configuration in every table, plot and the report.

    ``cpu numba/numba+AT (auto)``, ``cuda csr_vector/notrans graph x4 local OSEM S8 +m +b``: the backend
    family (``cuda`` for one GPU and several), :func:`kernel_label`, the merge section size (``secN``),
    ``graph`` where iterations were replayed as CUDA graphs, ``xP`` and the layout on GPUs (``gpus=False``
    leaves them out: a configuration across GPU counts), then :func:`model_label`. The float64 reference
    is ``reference (float64)`` and its model.
    """
    if r.get("reference_mode"):
        return "reference (float64)" + model_label(r)
    s = f"{_family(r.get('backend'))} {kernel_label(r)}"
    if r.get("secsize"):
        s += f" sec{r['secsize']}"
    if r.get("graph"):
        s += " graph"
    count = r.get("gpus") or 1
    if gpus and (r.get("backend") != "cpu" or count != 1):
        s += f" x{count}"
        if count > 1:
            s += f" {r.get('layout')}"
    return s + model_label(r)


def label_terms(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """What the parts of the labels of ``rows`` mean, one short phrase per part some label uses.

    Only the terms that occur: a CPU-only summary is not told about CUDA
    graphs, GPU layouts or OSEM. The plots' notes and the tables' intros
    print these (:func:`config_label` makes the labels).
    """
    rows = list(rows)
    runs = [r for r in rows if not r.get("reference_mode")]
    labels = [config_label(r) for r in rows]
    terms = []
    if runs:
        terms.append("fp/bp: the forward- and back-projection kernels that ran")
    if any("+AT" in lab for lab in labels):
        terms.append("+AT: the back projection reads a stored transpose A^T")
    if any(r.get("bp") == "notrans" for r in runs):
        terms.append("notrans: it scatters with the rows of A, without A^T")
    if any(re.search(r"\((fp |bp )?auto\)", lab) for lab in labels):
        terms.append("(auto): the kernel auto chose")
    if any(r.get("secsize") for r in runs):
        terms.append("secN: merge's section size")
    if any(r.get("graph") for r in runs):
        terms.append("graph: iterations replayed as CUDA graphs")
    multi = {r.get("layout") for r in runs if (r.get("gpus") or 1) > 1}
    if any(_family(r.get("backend")) == "cuda" for r in runs):
        terms.append("xP: on P GPUs" + (" with a layout" if multi else ""))
    if "local" in multi:
        terms.append("local: one all-reduce of the image per iteration")
    if "thesis" in multi:
        terms.append("thesis: one all-reduce after each projection")
    if any((r.get("subsets") or 1) > 1 and not r.get("map_algorithm") for r in rows):
        terms.append("OSEM SK: K ordered subsets")
    if any(r.get("map_algorithm") for r in rows):
        terms.append("BSREM, OSL: MAP (its prior, rdp: relative difference, and its weight beta)"
                     + (", SK: passes of K subsets" if any((r.get("subsets") or 1) > 1 and r.get("map_algorithm")
                                                          for r in rows) else ""))
    map_labels = [map_label(r) for r in rows]
    terms += [what for word, what in (
        (" hessian", "hessian: BSREM's preconditioner with the prior's curvature"),
        (" offset=", "offset=O: its preconditioner offset"),
        (" relax=", "relax=L0,ETA: its relaxation L0 / (1 + n / ETA) (default 1,10)"),
        (" mean", "mean: each pass's image the mean of its sub-iterates"),
        (" halve=", "halve=P,...: the passes after which its subsets halve")) if any(word in lab for lab in map_labels)]
    if any(r.get("m") not in (None, "no") for r in rows):
        terms.append("+m: models the multiplicative factors (attenuation, normalisation)")
    if any(r.get("b") not in (None, "no") for r in rows):
        terms.append("+b: models the additive background (randoms, scatter)")
    if len(runs) < len(rows):
        refs = [r for r in rows if r.get("reference_mode")]
        what = ("the CPU reference of the same algorithm (MLEM, OSEM or MAP) in float64"
                if any(r.get("map_algorithm") for r in refs) else "the CPU reference MLEM in float64")
        terms.append(f"reference (float64): {what}")
    return terms


def group_rows(rows: list[dict[str, Any]]) -> OrderedDict[tuple, list[dict[str, Any]]]:
    """Rows grouped by configuration (every dimension but the repetition), in first-seen order."""
    groups: OrderedDict[tuple, list[dict[str, Any]]] = OrderedDict()
    for r in rows:
        groups.setdefault(tuple(r.get(k) for k in _CONFIG_KEYS), []).append(r)
    return groups


def _mean(vals: Iterable[Any]) -> float | None:
    v = [x for x in (_num(y) for y in vals) if x is not None]
    return float(np.mean(v)) if v else None



def run_image(row: Mapping[str, Any]) -> Path | None:
    """The final image a run's ``timings.json`` names (None if it names none); where the run directory
    has moved since, the file of that name beside its ``timings.json``."""
    image = (row.get("_outputs") or {}).get("image")
    if not image:
        return None
    if not Path(image).exists():  # the run directory moved: look beside its timings.json
        return Path(row["run"]) / Path(image).name
    return Path(image)


def exact_reference_problem(path: str | os.PathLike) -> tuple[str, str]:
    """``(matrix, data)`` of an exact reference image,
    ``results/{matrix}/runs/{data}/reference-exact[-it{iterations}]/image.h5``."""
    parts = Path(path).parts
    if len(parts) < 5 or not parts[-2].startswith("reference-exact") or parts[-4] != "runs":
        raise InputError(path, "not results/{matrix}/runs/{data}/reference-exact-it{iterations}/image.h5 (or reference-exact/image.h5)")
    return parts[-5], parts[-3]



# --------------------------------------------------------------------------- scaling
def _family(backend: Any) -> str:
    """``cuda`` for ``cuda`` (one GPU) and ``cuda-nccl`` (several GPUs, or graph capture): one backend family."""
    return str(backend or "").split("-")[0]


def _scaling_key(r: Mapping[str, Any]) -> tuple:
    """Every configuration dimension but the GPU count and the layout (kernels as configured)."""
    return (r.get("matrix"), r.get("data"), _family(r.get("backend")), r.get("_fp_requested") or r.get("fp"),
            r.get("_bp_requested") or r.get("bp"), r.get("secsize"), _graph_requested(r), r.get("dtype"))


def _graph_requested(r: Mapping[str, Any]) -> Any:
    """The run's graph setting as configured (True, False, ``auto``); rows without one: whether it replayed graphs."""
    asked = r.get("_graph_requested")
    return bool(r.get("graph")) if asked is None else asked


def scaling_label(rs: list[Mapping[str, Any]]) -> str:
    """The label of a configuration across GPU counts: :func:`config_label` without the GPU count and layout.

    ``rs`` are the runs of one configuration on its GPU counts. Where ``auto``
    chose different kernels on different counts, each kernel lists its choices
    (``csr_vector|merge``) in the order of the GPU counts; where ``graph: auto``
    replayed CUDA graphs on some counts only, the label ends in ``graph (auto)``.
    """
    ordered = sorted(rs, key=lambda r: int(_num(r.get("gpus")) or 1))
    base = dict(ordered[0])
    for k in ("fp", "bp"):
        base[k] = "|".join(dict.fromkeys(str(r.get(k)) for r in ordered))
    base["transpose"] = any(r.get("transpose") for r in ordered)
    graphs = {bool(r.get("graph")) for r in ordered}
    base["graph"] = graphs == {True}
    return config_label(base, gpus=False) + (" graph (auto)" if len(graphs) > 1 else "")


def scaling_table(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Scaling records: per configuration, GPU count and layout, of cuda configurations run on several GPU counts.

    Runs are grouped by every configuration dimension but ``gpus`` and
    ``layout`` (the backend names ``cuda`` and ``cuda-nccl`` count as one;
    the kernels are the configured ones). In each group, per ``(gpus,
    layout)``:

    - ``iteration_s``: the mean over repetitions of ``iteration_mean_s``
      (as in the timing table), and ``<step>_s`` likewise where timed;
    - ``speedup`` = T(1) / T(P), T(1) the time of the group's 1-GPU run
      whatever its layout label (``local`` where there are several; the
      one-GPU ``cuda`` backend unless graph capture), None without one;
    - ``efficiency`` = speedup / P;
    - ``bandwidth_per_gpu_GBps`` = bytes_per_iteration / P / T(P) / 1e9:
      ``bytes_per_iteration`` counts the whole A (and A^T where stored),
      which the P GPUs read in nnz-balanced parts, about 1/P each;
    - ``rel_l2_reference``: mean over repetitions;
    - ``slower_than``: ``(P', T(P'))`` of the fewest GPUs P' < P (any layout) that ran the
      configuration faster than P do, None where none did (more GPUs never slower);
    - ``runs``: the run ids of the record's rows; ``configuration``: :func:`scaling_label`.

    Returns
    -------
    list of dict
        In first-seen order of the groups, by GPU count then layout within one;
        empty where no cuda configuration ran on more than one GPU count.
    """
    groups: OrderedDict[tuple, list[Mapping[str, Any]]] = OrderedDict()
    for r in rows:
        if r.get("reference_mode") or _family(r.get("backend")) != "cuda" or _num(r.get("gpus")) is None:
            continue
        groups.setdefault(_scaling_key(r), []).append(r)
    out: list[dict[str, Any]] = []
    for rs in groups.values():
        if len({int(r["gpus"]) for r in rs}) < 2:
            continue
        cells: OrderedDict[tuple[int, str], list[Mapping[str, Any]]] = OrderedDict()
        for r in sorted(rs, key=lambda r: (int(r["gpus"]), str(r.get("layout")))):
            cells.setdefault((int(r["gpus"]), str(r.get("layout"))), []).append(r)
        ones = [k for k in cells if k[0] == 1]
        base = (1, "local") if (1, "local") in cells else (ones[0] if ones else None)
        t1 = _mean(r["iteration_mean_s"] for r in cells[base]) if base else None
        label = scaling_label(rs)
        for (p, layout), cs in cells.items():
            t = _mean(c["iteration_mean_s"] for c in cs)
            nbytes = _mean(c.get("bytes_per_iteration") for c in cs)
            speedup = t1 / t if t1 and t else None
            rec: dict[str, Any] = {
                "matrix": cs[0].get("matrix"), "data": cs[0].get("data"), "configuration": label,
                "gpus": p, "layout": layout, "reps": len(cs), "iteration_s": t,
                **{f"{s}_s": _mean(c.get(f"{s}_mean_s") for c in cs) for s in STEPS},
                "steps_from": cs[0].get("steps_from"),
                "speedup": speedup, "efficiency": speedup / p if speedup is not None else None,
                "bandwidth_per_gpu_GBps": nbytes / p / t / 1e9 if nbytes and t else None,
                "rel_l2_reference": _mean(c.get("rel_l2_reference") for c in cs),
                "deterministic": all(c.get("deterministic") for c in cs),
                "slower_than": None,
                "runs": sorted({str(c.get("run")) for c in cs}),
            }
            for (q, _), qs in cells.items():
                tq = _mean(c["iteration_mean_s"] for c in qs)
                if q < p and t and tq and tq < t:
                    rec["slower_than"] = (q, tq)
                    break
            out.append(rec)
    return out



# --------------------------------------------------------------------------- the thesis beside us
def thesis_table(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Our configurations on a thesis matrix beside the thesis's run (:mod:`mlemlib.thesis`).

    For every published run whose matrix has the shape of some run of ours:
    first the thesis's record, then one per configuration of ours on that
    matrix (every configuration dimension, GPU count and layout included;
    the float64 reference left out), in first-seen order; ``beside`` holds
    the :class:`mlemlib.thesis.ThesisRun` of both. Each record has
    ``iteration_s`` and ``fp_s``, ``bp_s``, ``allreduce_s`` (mean over
    repetitions; None where not timed), ``gpus``, ``gpu_model``,
    ``theoretical_per_gpu_GBps``, ``theoretical_GBps`` (all GPUs),
    ``measured_GBps`` (our copy bandwidth, all GPUs), ``speedup`` = T_thesis /
    T_ours, ``bandwidth_ratio`` = ours / the thesis's aggregate theoretical
    bandwidth, ``kernel_gain`` = speedup / bandwidth_ratio, and
    ``energy_per_iteration_J``, ``energy_gpus``.
    """
    from mlemlib import thesis

    rows = [r for r in rows if not r.get("reference_mode")]
    out: list[dict[str, Any]] = []
    for run in thesis.RUNS:
        ours = [r for r in rows if r.get("_shape") == run.matrix.shape]
        if not ours:
            continue
        t_thesis = run.iteration_s
        theo_thesis = run.theoretical_bandwidth / 1e9
        out.append({
            "thesis": True, "beside": run, "matrix": run.matrix.name, "data": f"{run.table}, run {run.runs}x",
            "configuration": run.label, "reps": run.runs, "gpus": run.gpus, "gpu_model": run.gpu.model,
            "theoretical_per_gpu_GBps": run.gpu.theoretical_bandwidth / 1e9, "theoretical_GBps": theo_thesis,
            "measured_GBps": None, "iteration_s": t_thesis,
            **{f"{s}_s": run.steps.get(s) for s in STEPS},
            "speedup": 1.0, "bandwidth_ratio": 1.0, "kernel_gain": 1.0,
            "energy_per_iteration_J": None, "energy_gpus": None,
        })
        for rs in group_rows(ours).values():
            r0 = rs[0]
            t = _mean(r["iteration_mean_s"] for r in rs)
            theo = _mean(r.get("gpu_bandwidth_theoretical_GBps") for r in rs)
            speedup = t_thesis / t if t else None
            ratio = theo / theo_thesis if theo else None
            counted = {r.get("energy_gpus") for r in rs if r.get("energy_gpus") is not None}
            stored = r0.get("_stored_rows")
            matrix = r0["matrix"] + (f" (folded: each LOR once, {stored:,} stored rows)" if stored else "")
            out.append({
                "thesis": False, "beside": run, "matrix": matrix, "data": r0["data"],
                "configuration": config_label(r0),
                "reps": len(rs), "gpus": int(_num(r0.get("gpus")) or 1), "gpu_model": r0.get("_gpu_model") or "",
                "theoretical_per_gpu_GBps": r0.get("_gpu_theoretical_GBps"), "theoretical_GBps": theo,
                "measured_GBps": _mean(r.get("gpu_bandwidth_measured_GBps") for r in rs), "iteration_s": t,
                **{f"{s}_s": _mean(r.get(f"{s}_mean_s") for r in rs) for s in STEPS},
                "steps_from": r0.get("steps_from"),
                "speedup": speedup, "bandwidth_ratio": ratio,
                "kernel_gain": speedup / ratio if speedup is not None and ratio else None,
                "energy_per_iteration_J": _mean(r.get("energy_per_iteration_J") for r in rs),
                "energy_gpus": min(counted) if counted else None,
            })
    return out



# --------------------------------------------------------------------------- other records
def read_benchmark_tsv(path: str | os.PathLike) -> dict[str, Any]:
    """Seconds and peak memory of a Snakemake ``benchmark:`` file (all its rows: mean, min, max)."""
    p = Path(path)
    try:
        with open(p, encoding="utf-8", newline="") as fh:
            recs = list(csv.DictReader(fh, delimiter="\t"))
    except OSError as exc:
        raise InputError(p, f"cannot read benchmark file ({exc})") from None
    secs = [_num(r.get("s")) for r in recs]
    secs = [s for s in secs if s is not None]
    if not secs:
        raise InputError(p, "no 's' column with seconds (not a Snakemake benchmark file)")
    rss = [_num(r.get("max_rss")) for r in recs]
    rss = [v for v in rss if v is not None]
    return {"n": len(secs), "mean_s": float(np.mean(secs)), "min_s": min(secs), "max_s": max(secs),
            "max_rss_MB": max(rss) if rss else None}


def _transpose_label(p: Path) -> tuple[str, str]:
    """(matrix, method) from ``.../{matrix}/transpose[-method].h5`` or ``.../{matrix}[-method].tsv``."""
    stem = p.name.split(".")[0]
    if stem.startswith("transpose"):
        method = stem[len("transpose-"):] if stem.startswith("transpose-") else ""
        return p.resolve().parent.name, method
    for meth in _TRANSPOSE_METHODS:
        if stem.endswith("-" + meth):
            return stem[: -len(meth) - 1], meth
    return stem, ""


def transpose_rows(transposes: Iterable[Any] = (), benchmarks: Iterable[Any] = ()) -> list[dict[str, Any]]:
    """Transposition records, one per matrix and method, from ``transpose.h5`` attributes and benchmark files.

    A ``transpose.h5`` gives ``transpose_s``, the transposition alone as
    measured inside the job (its ``seconds`` attribute), and ``threads``; the
    Snakemake benchmark of the job that wrote it gives the whole job's time
    (``job_n``, ``job_mean_s``, ``job_min_s``, ``job_max_s``, ``max_rss_MB``).
    Files are matched by name: ``results/{matrix}/transpose.h5`` with
    ``benchmarks/transpose/{matrix}.tsv`` (the configured method, the A^T the
    runs read: ``used_by_runs``), ``transpose-{method}.h5`` with
    ``{matrix}-{method}.tsv``.
    """
    recs: OrderedDict[tuple[str, str], dict[str, Any]] = OrderedDict()

    def rec(matrix: str, file_method: str) -> dict[str, Any]:
        return recs.setdefault((matrix, file_method), {
            "matrix": matrix, "method": file_method, "used_by_runs": not file_method, "transpose_s": None,
            "threads": None, "job_n": None, "job_mean_s": None, "job_min_s": None, "job_max_s": None,
            "max_rss_MB": None, "files": []})

    for path in transposes:
        import h5py

        p = Path(path)
        try:
            with h5py.File(p, "r") as f:
                attrs = {k: f.attrs[k] for k in f.attrs}
        except OSError as exc:
            raise InputError(p, f"not a readable HDF5 file ({exc})") from None
        matrix, file_method = _transpose_label(p)
        r = rec(matrix, file_method)
        meth = attrs.get("method", file_method)
        r["method"] = (meth.decode() if isinstance(meth, bytes) else str(meth)) or file_method
        r["transpose_s"] = _num(attrs.get("seconds"))
        r["threads"] = _num(attrs.get("threads"))
        r["files"].append(os.fspath(p))
    for path in benchmarks:
        p = Path(path)
        b = read_benchmark_tsv(p)
        matrix, file_method = _transpose_label(p)
        r = rec(matrix, file_method)
        r.update(job_n=b["n"], job_mean_s=b["mean_s"], job_min_s=b["min_s"], job_max_s=b["max_s"],
                 max_rss_MB=b["max_rss_MB"])
        r["files"].append(os.fspath(p))
    for r in recs.values():
        r["method"] = r["method"] or "(the configured method)"
    return list(recs.values())


