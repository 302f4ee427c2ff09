"""The MLEM iteration, independent of the backend: :func:`reconstruct` and :func:`reference` (all backends).

:func:`reconstruct` takes what is reconstructed, a
:class:`~mlemlib.problem.ModelSpec` (system matrix ``A``, measurement ``g``,
norm, optionally ``A^T``, subsets, ``m``, ``b``, the MAP prior), and how, a
:class:`~mlemlib.problem.RunSettings` (iterations, repetitions, checkpoints,
backend, kernels, GPUs...), both validated when made. It loads the problem once,
builds a backend from it and the settings (:func:`build_backend`: ``cpu``,
``cuda`` on one or several GPUs; MAP wraps it), and runs the numerical contract
of DESIGN.md ``repetitions`` times::

    f0 = sum(g) / sum(norm)                  (sums in float64)
    fp = A f ; c = g / fp (0 where fp == 0) ; bp = A^T c ; f <- f * bp / norm (f * bp where norm == 0)

and, where asked, OSEM with multiplicative factors ``m`` and a background
``b`` (:mod:`mlemlib.subsets`, :mod:`mlemlib.corrections`): each iteration
visits the S subsets in order, ``c = m g / (m A f + b)`` and the norm of a
subset is its sensitivity ``s^k = sum_{i in S_k} a_ij m_i``.

Every iteration's step times are kept; every ``checkpoint_every`` iterations
the image is saved atomically (HDF5, with the iteration and a hash of the
inputs) so that a killed run resumes where it stopped and ends with the same
image, bit for bit, on a deterministic backend. It writes ``image.h5`` (grid
shape, voxel size), ``image.raw`` (nCols float32, no header, for the existing
tools) and ``timings.json`` (per-step statistics per repetition, set-up
times, backend and device facts, accuracy). The set-up is recorded per phase
(:mod:`mlemlib.setup_times`: opening and reading the matrix, copies to the
GPU, compilation, tuning, warm-up; ``setup.phases``), and where the iterations
start the log says how long after the process's start that is
(``setup.first_iteration_s``). On GPUs it also records each
GPU's measured copy bandwidth once per run (in the backend's device facts)
and each repetition's energy from NVML (:class:`mlemlib.devices.EnergyMeter`):
``energy_J``, ``energy_per_iteration_J``, ``power_W``, None where not
available (the CPU, no ``pynvml``, a GPU without the counter).

A reordered matrix (``mlem reorder``, :mod:`mlemlib.reorder`) is run in its
permuted space and transparently so: the measurement is read in the user's
LOR order and permuted (``g' = g[rows]``) before the problem is fingerprinted,
the iterated images (and checkpoints) are in the permuted voxel order, and the
image is mapped back to the user's voxel order before it is measured against
the reference and truth (both in the user's order) and written. A folded
matrix (:mod:`mlemlib.fold`: each distinct row stored once) is as
transparent: the measurement is read in the user's LOR order and folded
(each stored row gets the sum of its LORs' counts) before the permutation,
and its norm counts each stored row as often as it occurs.

:func:`reference` is the same loop in float64 on the CPU: the yardstick every
run of the problem is measured against (``reference.h5``).

The concerns beside the loop have their own modules: :mod:`mlemlib.problem`
(the model and the settings: :class:`~mlemlib.problem.ModelSpec`,
:class:`~mlemlib.problem.RunSettings`; loading a problem:
:class:`~mlemlib.problem.Problem`), :mod:`mlemlib.checkpoint` (checkpoint
files) and :mod:`mlemlib.provenance` (fingerprints, ``timings.json``). Their
public names stay importable from here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mlemlib import setup_times
from mlemlib._io import atomic_path
from mlemlib.backends import make_backend
from mlemlib.backends.base import Backend, timed_iterations
from mlemlib.checkpoint import (
    CHECKPOINT_FORMAT,
    checkpoint_key,
    read_checkpoint,
    read_resume,
    write_checkpoint,
)
from mlemlib.devices import EnergyMeter, backend_gpus, capped_between, energy_record
from mlemlib.image import read_image, write_image, write_raw
from mlemlib.problem import ModelSpec, Problem, RunSettings, close_all, load_problem
from mlemlib.provenance import (
    TIMINGS_FORMAT,
    dumps,
    matrix_fingerprint,
    problem_fingerprint,
    timings_record,
    transpose_used,
)
from mlemlib.timing import StepTimes, Stopwatch, format_seconds

__all__ = [
    "CHECKPOINT_FORMAT",
    "TIMINGS_FORMAT",
    "ModelSpec",
    "Problem",
    "RunSettings",
    "checkpoint_key",
    "matrix_fingerprint",
    "problem_fingerprint",
    "read_checkpoint",
    "read_image",
    "reconstruct",
    "reference",
    "reference_mlem",
    "transpose_used",
    "write_checkpoint",
]

log = logging.getLogger(__name__)


def reconstruct(
    model: ModelSpec,
    settings: RunSettings,
    out_image: str | os.PathLike,
    *,
    reference: Any | None = None,
    truth: Any | None = None,
    checkpoint: str | os.PathLike | None = None,
    keep_checkpoint: bool = False,
    timings_out: str | os.PathLike | None | bool = None,
    raw_out: str | os.PathLike | None | bool = None,
    device_info: dict[str, Any] | None = None,
    progress: Callable[[int, int, Any], None] | None = None,
) -> dict[str, Any]:
    """Reconstruct ``model`` as ``settings`` say: MLEM (OSEM with subsets, MAP with a prior); write
    ``image.h5``, ``image.raw`` and ``timings.json``.

    Parameters
    ----------
    model
        What is reconstructed (:class:`mlemlib.problem.ModelSpec`): the matrix, the measurement, the norm,
        ``A^T``, the subsets, the factors ``m`` and ``b`` (``ybar = m * (A f) + b``), the MAP prior, the
        names in tables. With a prior each iteration is a pass over the subsets and ``timings.json``'s
        ``map`` records the settings and ``Phi``, the log-likelihood and ``R`` per pass.
    settings
        How (:class:`mlemlib.problem.RunSettings`, validated when made): iterations, repetitions,
        checkpoints, the backend and its kernels, GPUs, layout, graphs, plan, chunks, threads, or the
        float64 reference (``reference_mode``, see :func:`reference`).
    out_image
        The ``image.h5`` to write (in the user's voxel order).
    reference
        ``reference.h5`` (or an array): the float64 MLEM of the same problem
        and iteration count, for the relative L2 error.
    truth
        ``truth.h5`` (or an array) of a simulated phantom.
    checkpoint
        Checkpoint file (default: ``<out_image stem>.checkpoint.h5`` beside the
        image). Where it exists, the run resumes from it; it is removed once the
        outputs are written (unless ``keep_checkpoint``). For a reordered matrix
        its image is in the permuted voxel order (its key is that of the
        permuted problem).
    timings_out
        ``timings.json`` path (default: ``timings.json`` beside the image; none in reference mode;
        False: none).
    raw_out
        ``image.raw`` path (default: the image's path with suffix ``.raw``, none in reference mode;
        False: none).
    device_info
        Facts about the device(s) recorded in ``timings.json``.
    progress
        Called as ``progress(repetition, iteration, image)`` after every
        iteration (and after its checkpoint), e.g. for a progress bar. The
        backend is synchronised first, so ``image`` is final; the GPU then
        idles while the callback runs.
        ``image`` is the backend's device image: for a reordered matrix it is
        in the permuted voxel order (``mlemlib.reorder.image_to_user_order``
        maps it back).

    Returns
    -------
    dict
        The content of ``timings.json``.
    """
    out_image = Path(out_image)
    ckpt_path = Path(checkpoint) if checkpoint is not None else out_image.with_name(out_image.stem + ".checkpoint.h5")
    checkpointed = settings.checkpoint_every > 0 or checkpoint is not None
    use_checkpoint = checkpointed and ckpt_path.exists()
    opened: list[Any] = []
    try:
        # one record of the set-up's phases, from loading the problem to the backend's warm-up (the backend
        # joins it): timings.json's setup.phases
        with setup_times.recording() as rec:
            with setup_times.phase("problem"):
                prob = load_problem(opened, model, settings, reference=reference, truth=truth)
            resume = read_resume(ckpt_path, key=prob.key, n=prob.shape[1], dtype=settings.dtype,
                                 repetitions=settings.repetitions, iterations=settings.iterations
                                 ) if use_checkpoint else None
            with Stopwatch() as sw_setup:
                be = build_backend(prob, settings)
        opened.append(be)  # closed at the end (a multi-GPU backend drops its graphs before its communicators)
        phases = rec.as_dict()
        desc = be.describe()
        log.info("backend %s ready (%.2f s): %s", desc.get("backend", settings.backend), sw_setup.seconds, desc)
        gpus_used = backend_gpus(desc)
        if gpus_used:  # once per run, after the set-up's timing: each GPU's copy bandwidth, the yardstick
            from mlemlib.bench import record_copy_bandwidths

            record_copy_bandwidths(gpus_used)
        energy = EnergyMeter(gpus_used, world=desc.get("gpus") or len(gpus_used))
        opened.append(energy)
        config = {
            "backend": desc.get("backend", settings.backend), "fp": desc.get("fp", settings.fp),
            "bp": desc.get("bp", settings.bp), "secsize": settings.secsize, "gpus": settings.gpus,
            "layout": settings.layout, "dtype": str(settings.dtype),
        }
        if not prob.corrections.plain:
            config["corrections"] = prob.corrections.identity()
        if desc.get("graph"):
            config["graph"] = True
        if resume is not None and resume["config"] is not None and resume["config"] != config:
            log.warning("%s: written by another configuration %s; resuming with %s", ckpt_path, resume["config"], config)
        # Under a launcher (one process per GPU) every rank holds the same image; rank 0 writes.
        writer = bool(getattr(be, "writes_output", True))
        first_s = setup_times.process_age()
        log.info("first iteration after %.1f s since the process started (set-up %.1f s)", first_s, phases["total"])
        records, host_img, others = _iterate(be, prob, settings, config, resume, ckpt_path if writer else None,
                                             progress, energy)
        timings = timings_record(
            prob, settings, desc, be, records, config,
            sources={**model.sources, "reference": reference, "truth": truth, "plan": settings.plan},
            matrix_name=model.matrix_name, data_name=model.data_name, device_info=device_info,
            setup_s=sw_setup.seconds,
        )
        timings["setup"].update(phases=phases, first_iteration_s=first_s)
        if prob.map is not None:
            timings["map"] = {**prob.map.record(), "history": be.history}
        return _write_outputs(
            out_image, host_img, timings, prob, writer=writer, raw_out=raw_out, timings_out=timings_out,
            ckpt_path=ckpt_path if checkpointed else None,
            keep_checkpoint=keep_checkpoint, others=others,
        )
    finally:
        close_all(opened)


def build_backend(model: Any, settings: Any) -> Any:
    """The backend of one run: ``model`` (a :class:`mlemlib.problem.Problem`) on the devices ``settings``
    (:class:`mlemlib.problem.RunSettings`) name, with the kernels they ask for.

    The backend gets the model's arrays in its stored-row order: the matrix (and ``A^T`` where given),
    ``g``, the norm (per subset with OSEM), the subsets' row bounds and ``b' = b / m``; it knows nothing of
    where they came from (folded, reordered, the factor files). A model term above the projector (MAP's
    prior: ``model.map``) wraps it (:func:`mlemlib.map.wrap`), which on the GPUs hands the backend the
    algorithm's image step.
    """
    be = make_backend(
        settings.backend, model.src, model.g, model.norm, model.tsrc, fp=settings.fp, bp=settings.bp,
        dtype=settings.dtype, gpus=settings.gpus, layout=settings.layout, plan=settings.plan,
        secsize=settings.secsize, threads=settings.threads, chunks=settings.chunks,
        background=model.corrections.background, subsets=model.corrections.bounds,
        **({"graph": settings.graph} if settings.graph is not None else {}),
    )
    if model.map is None:
        return be
    from mlemlib.map import wrap

    try:
        return wrap(be, model, model.map)
    except BaseException:
        if hasattr(be, "close"):
            be.close()
        raise


def _log_interval(iterations: int) -> int:
    """Log every iteration of a short run, about 20 lines for a long one."""
    return 1 if iterations <= 20 else max(1, iterations // 20)


def _iterate(be: Backend, prob: Problem, settings: RunSettings, config: dict[str, Any], resume: dict[str, Any] | None,
             ckpt_path: Path | None, progress: Callable[[int, int, Any], None] | None,
             energy: EnergyMeter | None = None) -> tuple[list[dict], np.ndarray, dict[str, np.ndarray]]:
    """Run every repetition (from ``resume`` where given); checkpoint (where ``ckpt_path``); return the records, the
    final image and the other repetitions' images that differ from it, by their SHA-256 (a run with atomics:
    :func:`_write_outputs` keeps them, so that the summary measures every repetition against the reference).

    Where ``energy`` is available, each repetition's GPU energy is read
    before and after its iteration loop, the GPUs synchronised first (an
    iteration may still run when ``iterate`` returns), outside the step
    timings; the record gets :func:`mlemlib.devices.energy_record`'s fields
    (None where not measured).
    """
    from mlemlib import metrics

    iterations, repetitions = settings.iterations, settings.repetitions
    records: list[dict[str, Any]] = list(resume["records"]) if resume else []
    start_rep = resume["repetition"] if resume else 0
    every = _log_interval(iterations)
    host_img = final = f = None
    distinct: dict[str, np.ndarray] = {}
    # the image a pass gives (MAP's pass mean) where it is not the iterate the next pass starts from, which is
    # what a checkpoint keeps, so that a resumed run goes on exactly as an uninterrupted one
    output = getattr(be, "output_image", None) or (lambda image: image)
    for rep in range(start_rep, repetitions):
        times = StepTimes()
        if resume is not None and rep == start_rep:
            f = be.from_host(resume["image"])
            first = resume["iteration"] + 1
            if hasattr(be, "resume_at"):  # an algorithm whose passes differ (MAP's relaxation)
                be.resume_at(resume["iteration"])
            for step, vals in (resume["samples"] or {}).items():
                for v in vals:
                    times.samples.setdefault(step, []).append(float(v))
            rep_resumed = resume["resumed_at"]
        else:
            f = be.initial_image()
            first = 1
            rep_resumed = []
        metered = energy is not None and energy.available
        if metered:
            be.synchronize()  # the initial image's (or the previous repetition's) work is not this loop's
        e0 = energy.read() if metered else None
        caps0 = energy.capped() if metered else None
        t_rep = time.perf_counter()
        t_log = t_rep
        ckpt_s = 0.0
        def note(it: int, step_times: dict[str, float]) -> None:
            """Take iteration ``it``'s step times; log them every ``every`` iterations or 30 s."""
            nonlocal t_log
            times.add(step_times)
            now = time.perf_counter()
            if it % every == 0 or it == iterations or now - t_log >= 30.0:
                t_log = now
                mean = times.mean("iteration")
                left = (iterations - it) * mean + (repetitions - rep - 1) * iterations * mean
                parts = ", ".join(f"{k} {format_seconds(v)}" for k, v in step_times.items() if k != "iteration")
                log.info(
                    "repetition %d/%d iteration %d/%d: %s/iteration (%s), ETA %s",
                    rep + 1, repetitions, it, iterations, format_seconds(step_times["iteration"]), parts,
                    format_seconds(left),
                )

        def due(it: int) -> bool:
            return bool(ckpt_path is not None and settings.checkpoint_every and it % settings.checkpoint_every == 0)

        # A backend that pipelines has its times read one iteration late (timed_iterations): the
        # device never idles between iterations waiting for the host; they are read at once
        # before a checkpoint (which synchronises anyway) and after the last iteration.
        for it, f, ready in timed_iterations(be, f, first, iterations, read_now=due):
            for k, step_times in ready:
                note(k, step_times)
            if due(it):
                t_ck = time.perf_counter()
                state = {"config": config, "records": records, "samples": times.to_json(), "resumed_at": rep_resumed}
                write_checkpoint(ckpt_path, be.to_host(f), key=prob.key, repetition=rep, iteration=it, state=state)
                ckpt_s += time.perf_counter() - t_ck
            if progress is not None:
                be.synchronize()  # the image is final (a replay's overflow check may still be pending)
                progress(rep, it, output(f))
        if metered:
            be.synchronize()
        e1 = energy.read() if metered else None
        caps1 = energy.capped() if metered else None
        loop_s = time.perf_counter() - t_rep
        joules = e1 - e0 if e0 is not None and e1 is not None else None
        energy_fields = energy_record(joules, loop_s, iterations - first + 1,
                                      energy.note if energy is not None else "not measured",
                                      len(energy.gpus) if energy is not None else 0, capped_between(caps0, caps1))
        with Stopwatch() as sw_back:
            host_img = prob.to_user(be.to_host(output(f)))
        acc = metrics.accuracy(host_img, reference=prob.reference, truth=prob.truth, regions=prob.regions)
        final = acc["image_sha256"]
        distinct.setdefault(final, host_img)
        records.append({
            "repetition": rep,
            "iterations": iterations,
            "resumed_at": rep_resumed,
            "wall_s": time.perf_counter() - t_rep,
            "checkpoint_s": ckpt_s,
            "readback_s": sw_back.seconds,
            "steps": times.summary(),
            "samples": times.to_json(),
            "accuracy": acc,
            **energy_fields,
        })
        log.info(
            "repetition %d/%d done: mean %s/iteration, image sum %.9g%s%s",
            rep + 1, repetitions, format_seconds(times.mean("iteration")), acc["image_sum"],
            f", rel. L2 to reference {acc['rel_l2_reference']:.3g}" if "rel_l2_reference" in acc else "",
            f", GPU energy {joules:.4g} J ({energy_fields['power_W']:.4g} W)" if energy_fields["power_W"] else "",
        )
    if records and f is not None:
        sample = _steps_kernel_by_kernel(be, f, iterations)
        if sample:
            records[-1]["steps_kernel_by_kernel"] = sample
    return records, host_img, {sha: img for sha, img in distinct.items() if sha != final}


#: Iterations launched kernel by kernel after a run that replayed CUDA graphs, to time its steps.
STEP_SAMPLE_ITERATIONS = 5


def _steps_kernel_by_kernel(be: Backend, f: Any, iterations: int) -> dict[str, dict[str, float | int]] | None:
    """The steps' times of a run that replayed CUDA graphs (a replay times only the whole iteration).

    After the last repetition (its image already read back), :data:`STEP_SAMPLE_ITERATIONS` more
    iterations from its final image are launched kernel by kernel, their images dropped, and their
    step times summarised; the graphs are replayed again afterwards. None for a run without graphs.
    """
    if not getattr(be, "graph", False) or not hasattr(be, "use_graph"):
        return None
    n = min(STEP_SAMPLE_ITERATIONS, iterations)
    if n < 1:
        return None
    times = StepTimes()
    be.use_graph(False)
    try:
        for _, f, ready in timed_iterations(be, f, 1, n):
            for _, step_times in ready:
                times.add(step_times)
    finally:
        be.use_graph(True)
    summary = times.summary()
    log.info("steps of %d iterations launched kernel by kernel (the run replayed CUDA graphs): %s", n,
             ", ".join(f"{k} {format_seconds(v['mean'])}" for k, v in summary.items()))
    return summary


def _write_outputs(out_image: Path, host_img: np.ndarray, timings: dict[str, Any], prob: Problem, *, writer: bool,
                   raw_out: Any, timings_out: Any, ckpt_path: Path | None, keep_checkpoint: bool,
                   others: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """Write ``image.h5`` (with ``others``, the other repetitions' distinct images, under ``/repetitions``),
    ``image.raw`` and ``timings.json`` (rank 0 only); drop the checkpoint; return the timings."""
    from mlemlib import metrics

    cfg = timings["config"]
    reference_mode = cfg["reference_mode"]
    attrs = {
        "iterations": cfg["iterations"],
        "repetitions": cfg["repetitions"],
        "backend": cfg["backend"],
        "fp": cfg["fp"],
        "bp": cfg["bp"],
        "gpus": cfg["gpus"],
        "layout": cfg["layout"],
        "dtype": cfg["dtype"],
        "reorder": cfg["reorder"],
        "subsets": cfg["subsets"],
        "problem": prob.fingerprint,
        "reference": reference_mode,
        "deterministic": timings["deterministic"],
        "matrix": cfg["matrix_path"],
        "sino": cfg["sino"],
        "image_sum": metrics.image_sum(host_img),
        "created": timings["created"],
    }
    raw_path = None
    if raw_out is not False and not (raw_out is None and reference_mode):
        raw_path = out_image.with_suffix(".raw") if raw_out in (None, True) else Path(raw_out)
    tpath = None
    if timings_out is not False and not (timings_out is None and reference_mode):
        tpath = Path(timings_out) if timings_out not in (None, True) else out_image.with_name("timings.json")
    timings["outputs"] = {
        "image": os.fspath(out_image),
        "raw": os.fspath(raw_path) if raw_path else None,
        "timings": os.fspath(tpath) if tpath else None,
    }
    if not writer:
        log.info("not the writing rank: leaving %s to rank 0", out_image)
        return timings
    write_image(out_image, host_img, grid=prob.grid, voxel_size=prob.voxel_size, attrs=attrs, others=others)
    if raw_path is not None:
        write_raw(raw_path, host_img)
    if tpath is not None:
        with atomic_path(tpath) as tmp:
            tmp.write_text(dumps(timings, indent=1, allow_nan=False) + "\n")
    if ckpt_path is not None and ckpt_path.exists() and not keep_checkpoint:
        ckpt_path.unlink()
    log.info("wrote %s", out_image)
    return timings


def reference(
    model: ModelSpec,
    settings: RunSettings,
    out: str | os.PathLike,
    *,
    truth: Any | None = None,
    timings_out: str | os.PathLike | None = None,
    checkpoint: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """The float64 reference MLEM (OSEM, MAP) of ``model``, written to ``out`` (``reference.h5``).

    The same loop as :func:`reconstruct` with ``settings`` in reference mode
    (``reference_mode=True``: the cpu backend in float64; ``auto``: the Numba
    kernels on ``settings.threads`` threads, float32 values widened exactly,
    no float64 copy of the matrix; SciPy's with one thread). The image file
    records the problem hash and the iteration count, which :func:`reconstruct`
    checks before comparing against it; no ``image.raw``. ``timings_out`` also
    writes its ``timings.json``. The model is the run's: the reference of a
    run models what the run models (subsets, ``m``, ``b``, the prior: a MAP
    run's reference is the same algorithm in float64).
    """
    return reconstruct(model, dataclasses.replace(settings, reference_mode=True), out, truth=truth,
                       timings_out=timings_out, raw_out=False, checkpoint=checkpoint)


#: Alias used by the workflow's ``reference_mlem`` rule.
reference_mlem = reference

