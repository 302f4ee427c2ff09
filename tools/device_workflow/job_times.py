#!/usr/bin/env python3
"""Where a workflow run's wall time went, per job, from what Snakemake already writes (issue 40).

Reads, in the working directory of one ``snakemake`` run (standard library only):

- Snakemake's log (``.snakemake/log/*.snakemake.log``, or its captured output
  given with ``--snakemake-log``): every job's rule, jobid, wildcards, input,
  output, log and benchmark paths, threads and ``gpu`` resource, and when it
  started and finished, to the whole second (Snakemake writes ``time.asctime()``);
- Snakemake's metadata (``.snakemake/metadata/``, one JSON record per output
  file): ``starttime`` (when the job was marked incomplete, i.e. started) and
  ``endtime`` (the output's modification time), as Unix times to the
  microsecond; they replace the log's whole seconds where present;
- each job's ``benchmark:`` file (``s``: the seconds its script ran, 0.01 s);
- each job's ``log:`` (mlemlib.logs.LOG_FORMAT, milliseconds): for the MLEM
  jobs the lines ``leased GPU(s) ...``, ``loaded problem ... (X s)``,
  ``backend ... ready (X s)``, the first ``repetition 1/R iteration k/N``,
  the last ``repetition r/R done``, and where a backend logs its set-up's
  phases (``... backend: set-up 12.3 s: read 7.7 GB in 9.1 s (0.85 GB/s), ...``)
  what it read;
- the sizes of each job's input files (what an MLEM job reads before its
  first iteration: the matrix, its transpose, the measurement, the norm).

Prints markdown: the total, one row per job (start and end in seconds after
the workflow's start), the MLEM jobs from their start to their first
iteration (with the time to read their inputs at the disk's speed when
``--disk-bw`` gives it), the targets given as options, and the critical path:
the chain of jobs, each waiting for the last-finished of its inputs' jobs,
that ends with the last job, so that its jobs' seconds and the gaps between
them add up to the wall time; also the longest chain of dependencies by job
seconds (the wall time with every core and GPU free at once).

Usage::

    python3 tools/device_workflow/job_times.py WORKDIR [--snakemake-log FILE] [--started EPOCH] [--total S]
        [--disk-bw BYTES_PER_S] [--disk-note TEXT] [--target-total S] [--target-reference S]
        [--target-first-iteration RATIO]

Exit status: 0 the tables were written; 2 no Snakemake log, no job in it, or a bad argument.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import json
import os
import re
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

#: Exit statuses.
EXIT_OK = 0
EXIT_INPUT = 2

MONTHS = {name: i for i, name in enumerate("Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec".split(), 1)}  # noqa: SIM905
#: Snakemake's ``[time.asctime()]`` line: "[Fri Nov 27 06:34:33 2026]" (day padded with a space).
STAMP = re.compile(r"^\[\w{3} (?P<mon>\w{3}) +(?P<day>\d{1,2}) (?P<hms>\d\d:\d\d:\d\d) (?P<year>\d{4})\]$")
RULE = re.compile(r"^(?:local)?(?:rule|checkpoint) (?P<rule>\S+):$")
FIELD = re.compile(r"^    (?P<key>[a-z_]+): (?P<value>.*)$")
FINISHED = re.compile(r"^Finished (?:jobid: |job )(?P<jobid>\d+)")
ERROR = re.compile(r"^Error in rule (?P<rule>\S+):$")
BANNER_DATE = re.compile(r"^\s*Date: (?P<date>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)$")
ELAPSED = re.compile(r"^Elapsed time: (?:(?P<days>\d+) days?, )?(?P<h>\d+):(?P<m>\d\d):(?P<s>\d\d(?:\.\d+)?)$")

#: A job log line of mlemlib.logs.LOG_FORMAT: "2026-11-23 10:00:01,234 INFO name: message".
LINE = re.compile(r"^(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) [A-Z]+ \S+: (?P<msg>.*)$")
LINE_TIME = "%Y-%m-%d %H:%M:%S,%f"
LEASED = re.compile(r"^leased GPU\(s\) (?P<devices>\S+) ")
LOADED = re.compile(r"^loaded problem \S+: .*\((?P<s>[0-9.]+) s\)$")
READY = re.compile(r"^backend \S+ ready \((?P<s>[0-9.]+) s\)")
ITERATION = re.compile(r"^repetition 1/\d+ iteration (?P<it>\d+)/\d+: ")
REPETITION_DONE = re.compile(r"^repetition \d+/\d+ done: ")
#: A backend's set-up line (mlemlib.setup_times) where it gives the bytes read: "read 7.7 GB in 9.1 s (0.85 GB/s)".
SETUP_READ = re.compile(r"backend: set-up .*?\b(?P<read>read [0-9.]+ [kMG]?B in [0-9.]+ s(?: \([0-9.]+ GB/s\))?)")

#: Rules whose jobs run MLEM (the run table).
MLEM_RULES = ("run_mlem", "reference_mlem", "exact_reference_mlem")
#: Rules of the float64 reference (the reference target).
REFERENCE_RULES = ("reference_mlem", "exact_reference_mlem")


class InputError(ValueError):
    """A working directory, log or argument that cannot be used."""


@dataclass
class JobLog:
    """What an MLEM job's own log says, as local times (None where the log does not say it)."""

    first: datetime | None = None
    last: datetime | None = None
    leased: datetime | None = None
    loaded: datetime | None = None
    load_s: float | None = None
    ready: datetime | None = None
    setup_s: float | None = None
    first_iteration: datetime | None = None
    first_iteration_number: int | None = None
    done: datetime | None = None
    read: str | None = None


@dataclass
class Job:
    """One job of the run.

    Attributes
    ----------
    jobid, rule, wildcards, threads, gpus
        As Snakemake's log gives them (``gpus``: the job's ``gpu`` resource).
    inputs, outputs, logs, benchmark
        Paths relative to the working directory.
    logged_start, logged_end
        Snakemake's whole-second times (``logged_end`` None: no "Finished" line).
    failed
        Snakemake logged an error for it.
    start, end
        The best times known (:func:`refine`): the metadata's start where
        present, the latest of the end estimates; ``end`` None for a job that
        did not finish.
    script_s
        The benchmark's seconds (None without a benchmark file).
    input_bytes
        The summed sizes of its input files that exist (None where none does).
    log
        What its log says (MLEM jobs).
    """

    jobid: int
    rule: str
    logged_start: datetime
    wildcards: str = ""
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)
    benchmark: str | None = None
    threads: int = 1
    gpus: int = 0
    logged_end: datetime | None = None
    failed: bool = False
    start: datetime | None = None
    end: datetime | None = None
    script_s: float | None = None
    input_bytes: int | None = None
    log: JobLog = field(default_factory=JobLog)

    @property
    def seconds(self) -> float | None:
        return (self.end - self.start).total_seconds() if self.end is not None and self.start is not None else None


@dataclass
class Run:
    """A parsed Snakemake log: the jobs by jobid, the banner's date and the elapsed time it logged."""

    jobs: dict[int, Job]
    date: datetime | None = None
    elapsed_s: float | None = None


def parse_stamp(m: re.Match[str]) -> datetime:
    """The local time of a :data:`STAMP` match (no locale needed)."""
    h, mi, s = (int(x) for x in m["hms"].split(":"))
    return datetime(int(m["year"]), MONTHS[m["mon"]], int(m["day"]), h, mi, s)


def _split(value: str) -> list[str]:
    return [p for p in (v.strip() for v in value.split(", ")) if p]


def _resource(value: str, name: str) -> int:
    for item in _split(value):
        key, _, val = item.partition("=")
        if key == name and val.isdigit():
            return int(val)
    return 0


def parse_snakemake_log(text: str) -> Run:
    """The jobs of a Snakemake log's text (its default, human-readable format).

    A job is a ``[timestamp]`` line, then ``rule NAME:`` (or ``localrule``)
    and its indented fields; it ends at ``Finished jobid: N`` (Snakemake 9;
    ``Finished job N.`` before) or fails at ``Error in rule NAME:`` whose
    ``jobid`` field names it. Jobs without outputs (the target rule ``all``)
    are left out.
    """
    jobs: dict[int, Job] = {}
    stamp: datetime | None = None
    block: dict[str, str] | None = None
    block_rule = ""
    block_start: datetime | None = None
    in_error = False
    date = elapsed = None

    def close() -> None:
        nonlocal block
        if block is not None and "jobid" in block and block_start is not None and block.get("output"):
            job = Job(jobid=int(block["jobid"]), rule=block_rule, logged_start=block_start)
            job.inputs = _split(block.get("input", ""))
            job.outputs = _split(block.get("output", ""))
            job.logs = _split(block.get("log", ""))
            job.benchmark = block.get("benchmark") or None
            job.wildcards = block.get("wildcards", "")
            job.threads = int(block["threads"]) if block.get("threads", "").isdigit() else 1
            job.gpus = _resource(block.get("resources", ""), "gpu")
            jobs[job.jobid] = job
        block = None

    for raw in text.splitlines():
        line = raw.rstrip()
        if (m := FIELD.match(line)) is not None:
            if block is not None:
                block[m["key"]] = m["value"]
            elif in_error and m["key"] == "jobid" and m["value"].isdigit():
                job = jobs.get(int(m["value"]))
                if job is not None:
                    job.failed, job.logged_end = True, stamp
            continue
        close()
        in_error = False
        if (m := STAMP.match(line)) is not None:
            stamp = parse_stamp(m)
        elif (m := RULE.match(line)) is not None:
            block, block_rule, block_start = {}, m["rule"], stamp
        elif (m := FINISHED.match(line)) is not None:
            job = jobs.get(int(m["jobid"]))
            if job is not None:
                job.logged_end = stamp
        elif ERROR.match(line) is not None:
            in_error = True
        elif (m := BANNER_DATE.match(line)) is not None:
            date = datetime.strptime(m["date"], "%Y-%m-%d %H:%M:%S")
        elif (m := ELAPSED.match(line)) is not None:
            elapsed = int(m["days"] or 0) * 86400 + int(m["h"]) * 3600 + int(m["m"]) * 60 + float(m["s"])
    close()
    return Run(jobs=jobs, date=date, elapsed_s=elapsed)


def parse_job_log(text: str) -> JobLog:
    """The times an MLEM job's log gives (see :class:`JobLog`); other logs give only ``first`` and ``last``."""
    out = JobLog()
    for raw in text.splitlines():
        m = LINE.match(raw.rstrip("\r"))
        if m is None:
            continue
        t = datetime.strptime(m["ts"], LINE_TIME)
        out.first = out.first or t
        out.last = t
        msg = m["msg"]
        if out.leased is None and LEASED.match(msg):
            out.leased = t
        elif out.loaded is None and (lm := LOADED.match(msg)) is not None:
            out.loaded, out.load_s = t, float(lm["s"])
        elif out.ready is None and (rm := READY.match(msg)) is not None:
            out.ready, out.setup_s = t, float(rm["s"])
        elif out.first_iteration is None and (im := ITERATION.match(msg)) is not None:
            out.first_iteration, out.first_iteration_number = t, int(im["it"])
        elif REPETITION_DONE.match(msg):
            out.done = t
        elif out.first_iteration is None and (sm := SETUP_READ.search(msg)) is not None:
            out.read = sm["read"]  # the last before the iterations: the outermost backend's
    return out


def read_benchmark_s(path: Path) -> float | None:
    """The seconds of a Snakemake benchmark TSV (column ``s``; summed over repeats), None if unreadable."""
    try:
        rows = path.read_text().splitlines()
    except OSError:
        return None
    if len(rows) < 2:
        return None
    header = rows[0].split("\t")
    if "s" not in header:
        return None
    col = header.index("s")
    total = 0.0
    for row in rows[1:]:
        cells = row.split("\t")
        try:
            total += float(cells[col])
        except (IndexError, ValueError):
            return None
    return total


def read_metadata(directory: Path) -> dict[str, tuple[float, float]]:
    """``output path -> (starttime, endtime)`` from Snakemake's ``.snakemake/metadata`` (empty if absent).

    A record's file name is the URL-safe base64 of the output's path, cut
    into folders whose names start with ``@`` where it is longer than a
    file name may be.
    """
    out: dict[str, tuple[float, float]] = {}
    if not directory.is_dir():
        return out
    for path in directory.rglob("*"):
        if not path.is_file():
            continue
        encoded = "".join(part.lstrip("@") for part in path.relative_to(directory).parts)
        try:
            key = base64.urlsafe_b64decode(encoded).decode()
            record = json.loads(path.read_text())
            out[key] = (float(record["starttime"]), float(record["endtime"]))
        except (binascii.Error, UnicodeDecodeError, ValueError, KeyError, TypeError, OSError):
            continue
    return out


def naive(epoch: float, offset: timedelta) -> datetime:
    """A Unix time as the naive local time of the logs (``offset``: local minus UTC)."""
    return datetime.fromtimestamp(epoch, UTC).replace(tzinfo=None) + offset


def local_offset(jobs: Iterable[Job], metadata: dict[str, tuple[float, float]]) -> timedelta:
    """The logs' local time minus UTC: from jobs whose start both Snakemake's log and the metadata give,
    rounded to a quarter of an hour (the log's seconds are cut); else this machine's."""
    diffs = []
    for job in jobs:
        starts = [metadata[o][0] for o in job.outputs if o in metadata]
        if starts:
            utc = datetime.fromtimestamp(min(starts), UTC).replace(tzinfo=None)
            diffs.append((job.logged_start - utc).total_seconds())
    if not diffs:
        now = datetime.now().astimezone().utcoffset()
        return now or timedelta(0)
    return timedelta(seconds=round(statistics.median(diffs) / 900) * 900)


def refine(run: Run, workdir: Path, metadata: dict[str, tuple[float, float]], offset: timedelta) -> None:
    """Fill each job's ``start``, ``end``, ``script_s``, ``input_bytes`` and ``log`` from the files of ``workdir``.

    ``start``: the earliest metadata start of its outputs, else the log's
    second. ``end`` (finished jobs): the latest of the log's "Finished"
    second, the metadata's end and start plus the benchmark's seconds, each of
    which can only be early.
    """
    for job in run.jobs.values():
        records = [metadata[o] for o in job.outputs if o in metadata]
        job.start = naive(min(r[0] for r in records), offset) if records else job.logged_start
        if job.benchmark:
            job.script_s = read_benchmark_s(workdir / job.benchmark)
        if job.logged_end is not None:
            ends = [job.logged_end]
            if records:
                ends.append(naive(max(r[1] for r in records), offset))
            if job.script_s is not None:
                ends.append(job.start + timedelta(seconds=job.script_s))
            job.end = max(ends)
        sizes = [(workdir / p).stat().st_size for p in job.inputs if (workdir / p).is_file()]
        job.input_bytes = sum(sizes) if sizes else None
        for name in job.logs:
            path = workdir / name
            if path.is_file():
                job.log = parse_job_log(path.read_text(errors="replace"))
                break


def producers(jobs: Sequence[Job]) -> dict[int, list[Job]]:
    """``jobid -> the jobs that wrote its inputs`` (outputs and benchmark files count)."""
    made_by: dict[str, Job] = {}
    for job in jobs:
        for path in [*job.outputs, *([job.benchmark] if job.benchmark else [])]:
            made_by[path] = job
    return {
        job.jobid: list({p.jobid: p for p in (made_by.get(i) for i in job.inputs) if p is not None}.values())
        for job in jobs
    }


def critical_path(jobs: Sequence[Job]) -> list[Job]:
    """The observed critical path: from the finished job that ended last, back through the input job that
    ended last, to a job with none; in the order run."""
    done = [j for j in jobs if j.end is not None]
    if not done:
        return []
    before = producers(done)
    chain = [max(done, key=lambda j: (j.end, j.jobid))]
    while before[chain[-1].jobid]:
        chain.append(max(before[chain[-1].jobid], key=lambda j: (j.end, j.jobid)))
    return chain[::-1]


def longest_chain(jobs: Sequence[Job]) -> tuple[float, list[Job]]:
    """The chain of dependencies with the most job seconds (finished jobs), and its seconds."""
    done = {j.jobid: j for j in jobs if j.end is not None}
    before = producers(list(done.values()))
    best: dict[int, tuple[float, list[Job]]] = {}

    def visit(job: Job, seen: frozenset[int]) -> tuple[float, list[Job]]:
        if job.jobid not in best:
            if job.jobid in seen:
                raise InputError(f"the jobs' inputs and outputs form a cycle through jobid {job.jobid}")
            prev = [visit(p, seen | {job.jobid}) for p in before[job.jobid]]
            s, chain = max(prev, key=lambda c: c[0], default=(0.0, []))
            best[job.jobid] = (s + (job.seconds or 0.0), [*chain, job])
        return best[job.jobid]

    chains = [visit(j, frozenset()) for j in done.values()]
    return max(chains, key=lambda c: c[0], default=(0.0, []))


def split_wildcards(jobs: Sequence[Job]) -> tuple[list[str], dict[int, str]]:
    """The ``key=value`` wildcards that at least two jobs have and no job has otherwise, and per jobid the
    rest (its first output where nothing is left), so that the tables name jobs by what tells them apart."""
    items = {j.jobid: _split(j.wildcards) for j in jobs}
    values: dict[str, set[str]] = {}
    counts: dict[str, int] = {}
    for its in items.values():
        for item in its:
            key, _, value = item.partition("=")
            values.setdefault(key, set()).add(value)
            counts[key] = counts.get(key, 0) + 1
    shared = {k for k, v in values.items() if len(v) == 1 and counts[k] >= 2}
    common = [f"{k}={next(iter(values[k]))}" for k in values if k in shared]
    rest = {}
    for j in jobs:
        kept = [item for item in items[j.jobid] if item.partition("=")[0] not in shared]
        rest[j.jobid] = ", ".join(kept) or (j.outputs[0] if j.outputs else "")
    return common, rest


def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _after(t: datetime | None, t0: datetime | None) -> float | None:
    return (t - t0).total_seconds() if t is not None and t0 is not None else None


@dataclass
class Options:
    """What the command line adds to the logs: the measured start and total, the disk, the targets."""

    started: datetime | None = None
    total_s: float | None = None
    disk_bw: float | None = None
    disk_note: str = ""
    target_total: float | None = None
    target_reference: float | None = None
    target_first_iteration: float | None = None


def first_iteration_s(job: Job) -> float | None:
    """Seconds from the job's start to its first logged iteration (None where none was logged)."""
    return _after(job.log.first_iteration, job.start)


def disk_read_s(job: Job, disk_bw: float | None) -> float | None:
    """Seconds to read the job's inputs at ``disk_bw`` bytes/s."""
    return job.input_bytes / disk_bw if job.input_bytes is not None and disk_bw else None


def report(run: Run, opts: Options, source: str) -> list[str]:
    """The markdown lines: total, jobs, MLEM jobs, targets, critical path."""
    jobs = sorted(run.jobs.values(), key=lambda j: (j.start or j.logged_start, j.jobid))
    t0 = opts.started or run.date or min(j.start or j.logged_start for j in jobs)
    ends = [j.end for j in jobs if j.end is not None]
    last_end = max(((e - t0).total_seconds() for e in ends), default=0.0)
    # Without the measured total: Snakemake's "Elapsed time" (counted from a moment after the banner's
    # whole second, so at least up to the last job's end).
    total = opts.total_s if opts.total_s is not None else max(run.elapsed_s or 0.0, last_end)
    common, rest = split_wildcards(jobs)
    unfinished = [j for j in jobs if j.end is None]
    lines = [
        (f"Total wall time: {total:.1f} s ({len(jobs)} jobs, {len(unfinished)} of them unfinished"
         f"{', ' + str(sum(j.failed for j in jobs)) + ' failed' if any(j.failed for j in jobs) else ''}); "
         f"times in s after {t0:%Y-%m-%d %H:%M:%S}, from {source}."),
        "",
        *([f"Wildcards shared by every job that has them (left out below): {', '.join(common)}.", ""] if common else []),
        ("| jobid | rule | wildcards (or output) | threads | GPUs | start | end | s | script s | input GB "
         "| to 1st iteration s |"),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for j in jobs:
        what = rest[j.jobid]
        end = _f(_after(j.end, t0)) if j.end is not None else ("failed" if j.failed else "unfinished")
        lines.append(
            f"| {j.jobid} | {j.rule} | {what} | {j.threads} | {j.gpus} | {_f(_after(j.start, t0))} | {end} | "
            f"{_f(j.seconds, 2)} | {_f(j.script_s, 2)} | "
            f"{_f(j.input_bytes / 1e9 if j.input_bytes is not None else None, 3)} | {_f(first_iteration_s(j), 2)} |"
        )
    lines += [
        "",
        ("start and end: Snakemake's metadata (to the microsecond; the log's whole seconds where it has none); "
         "s: end - start; script s: the job's benchmark file; input GB: its input files' sizes."),
    ]

    mlem = [j for j in jobs if j.rule in MLEM_RULES and j.log.first is not None]
    if mlem:
        lines += [
            "",
            "MLEM jobs from their start to their first iteration (s after the job's start, from its log):",
            "",
            ("| jobid | job | GPUs | leased | problem loaded | backend ready | 1st iteration "
             "| load + set-up s (log) | read (log) | input GB/s to ready | at disk speed s "
             "| 1st iteration / disk read | iterations s |"),
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for j in mlem:
            lg = j.log
            load = (lg.load_s or 0.0) + (lg.setup_s or 0.0) if lg.setup_s is not None else None
            to_ready = _after(lg.ready, j.start)
            gbps = j.input_bytes / 1e9 / to_ready if j.input_bytes and to_ready else None
            first = first_iteration_s(j)
            disk = disk_read_s(j, opts.disk_bw)
            ratio = first / disk if first is not None and disk else None
            it = f"{_f(first, 2)}" + (f" (it. {lg.first_iteration_number})" if (lg.first_iteration_number or 1) > 1 else "")
            lines.append(
                f"| {j.jobid} | {j.rule} {rest[j.jobid]} | {j.gpus} | "
                f"{_f(_after(lg.leased, j.start), 2)} | {_f(_after(lg.loaded, j.start), 2)} | {_f(to_ready, 2)} | "
                f"{it} | {_f(load, 2)} | {lg.read or '-'} | {_f(gbps, 2)} | {_f(disk, 2)} | {_f(ratio, 2)} | "
                f"{_f((lg.done - lg.ready).total_seconds() if lg.done and lg.ready else None, 2)} |"
            )
        lines += [
            "",
            ("The job's start is Snakemake's (its log starts once Python has imported mlemlib.logs). A run logs "
             "every iteration up to 20 iterations, else every N/20th: \"it. k\" marks a first logged iteration "
             "k > 1 (an iteration takes milliseconds). load + set-up s: the log's \"loaded problem (X s)\" plus "
             "\"backend ready (Y s)\"; read (log): what the backend's set-up line says it read; input GB/s to "
             "ready: the inputs' bytes over the seconds from the start to \"backend ready\"; iterations s: from "
             "\"backend ready\" to the last repetition's end."),
        ]
    if opts.disk_bw:
        lines += ["", f"Disk: {opts.disk_bw / 1e9:.2f} GB/s sequential read{'; ' + opts.disk_note if opts.disk_note else ''}."]
    elif opts.disk_note:
        lines += ["", f"Disk: {opts.disk_note}."]

    targets = target_lines(jobs, total, opts)
    if targets:
        lines += ["", "Targets (issue 40):", "", *targets]

    chain = critical_path(jobs)
    if chain:
        lines += [
            "",
            ("Critical path (each job waited for the last-finished job among its inputs' jobs; gap: from that "
             "job's end to this one's start):"),
            "",
            "| jobid | job | start | end | s | gap before s |",
            "|---|---|---|---|---|---|",
        ]
        prev_end = t0
        gaps = 0.0
        for j in chain:
            gap = (j.start - prev_end).total_seconds()
            gaps += gap
            lines.append(
                f"| {j.jobid} | {j.rule} {rest[j.jobid]} | {_f(_after(j.start, t0))} | {_f(_after(j.end, t0))} | {_f(j.seconds, 2)} "
                f"| {gap:.2f} |"
            )
            prev_end = j.end
        busy = sum(j.seconds or 0.0 for j in chain)
        tail = total - (chain[-1].end - t0).total_seconds()
        lines += [
            "",
            (f"{len(chain)} jobs: {busy:.1f} s in jobs + {gaps:.1f} s in gaps (the first: from the workflow's start, "
             f"Snakemake building the DAG) + {tail:.1f} s after the last job = {busy + gaps + tail:.1f} s "
             f"(total {total:.1f} s)."),
        ]
        longest_s, longest = longest_chain(jobs)
        lines.append(
            f"Longest chain of dependencies by job seconds: {longest_s:.1f} s "
            f"({' -> '.join(f'{j.rule} [{j.jobid}]' for j in longest)}): the wall time if no job waited for cores, "
            "GPUs or Snakemake."
        )
    if unfinished:
        lines += ["", "Unfinished: " + ", ".join(f"{j.rule} {rest[j.jobid]} [{j.jobid}]" for j in unfinished) + "."]
    return lines


def target_lines(jobs: Sequence[Job], total: float, opts: Options) -> list[str]:
    """One line per target given: what was measured and whether it is met."""

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    out = []
    if opts.target_total is not None:
        out.append(f"- whole workflow: {total:.1f} s, target <= {opts.target_total:g} s: {verdict(total <= opts.target_total)}")
    if opts.target_reference is not None:
        refs = [j for j in jobs if j.rule in REFERENCE_RULES]
        for j in refs:
            s, lg = j.seconds, j.log
            its = (lg.done - lg.ready).total_seconds() if lg is not None and lg.done and lg.ready else None
            if its is None:  # the job's seconds where its log does not say when the iterations ran
                out.append(
                    f"- float64 reference [{j.jobid}] ({j.threads} threads): {_f(s)} s, target <= "
                    f"{opts.target_reference:g} s: {verdict(s is not None and s <= opts.target_reference)}"
                )
            else:  # the target is the reference's iterations; the job also loads its problem
                out.append(
                    f"- float64 reference [{j.jobid}] ({j.threads} threads): its iterations {its:.1f} s, target <= "
                    f"{opts.target_reference:g} s: {verdict(its <= opts.target_reference)} (the job, with loading "
                    f"the matrix: {_f(s)} s)"
                )
        if not refs:
            out.append("- float64 reference: no reference_mlem job in this run")
    if opts.target_first_iteration is not None:
        gpu_runs = [j for j in jobs if j.rule == "run_mlem" and j.gpus > 0]
        for j in gpu_runs:
            first, disk = first_iteration_s(j), disk_read_s(j, opts.disk_bw)
            if first is None or disk is None:
                out.append(
                    f"- GPU run [{j.jobid}] on {j.gpus} GPU(s): first iteration "
                    f"{'not logged' if first is None else f'at {first:.2f} s'}, "
                    f"{'no disk speed' if disk is None else f'{disk:.2f} s to read its inputs at disk speed'}: not judged"
                )
                continue
            limit = opts.target_first_iteration * disk
            out.append(
                f"- GPU run [{j.jobid}] on {j.gpus} GPU(s): first iteration at {first:.2f} s, "
                f"{first / disk:.2f}x the {disk:.2f} s to read its {j.input_bytes / 1e9:.2f} GB of inputs at disk speed, "
                f"target <= {opts.target_first_iteration:g}x ({limit:.2f} s): {verdict(first <= limit)}"
            )
        if not gpu_runs:
            out.append("- GPU runs: none in this run")
    return out


def find_snakemake_log(workdir: Path) -> Path:
    """The newest ``.snakemake/log/*.snakemake.log`` of ``workdir``.

    Raises
    ------
    InputError
        If there is none.
    """
    logs = sorted((workdir / ".snakemake" / "log").glob("*.snakemake.log"))
    if not logs:
        raise InputError(f"{workdir}: no .snakemake/log/*.snakemake.log (give --snakemake-log)")
    return logs[-1]


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: read the run, print the markdown; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="job_times.py",
        description="Per-job times, the MLEM jobs' time to their first iteration and the critical path of one "
        "snakemake run, from its logs, benchmark files and metadata.",
        epilog="exit status: 0 written, 2 no Snakemake log or job, or a bad argument",
    )
    parser.add_argument("workdir", metavar="WORKDIR", help="the run's working directory (logs/, benchmarks/, .snakemake/)")
    parser.add_argument("--snakemake-log", metavar="FILE", help="Snakemake's log (default: the newest in WORKDIR/.snakemake/log)")
    parser.add_argument("--started", type=float, metavar="EPOCH", help="Unix time snakemake was started (default: its banner's date)")
    parser.add_argument("--total", type=float, metavar="S", help="the measured wall time of snakemake (default: its 'Elapsed time')")
    parser.add_argument("--disk-bw", type=float, metavar="BYTES_PER_S", help="the disk's sequential read speed")
    parser.add_argument("--disk-note", default="", metavar="TEXT", help="how the disk's speed was measured")
    parser.add_argument("--target-total", type=float, metavar="S", help="target wall time of the whole workflow")
    parser.add_argument("--target-reference", type=float, metavar="S",
                        help="target seconds of a float64 reference's iterations (its job's where its log lacks them)")
    parser.add_argument("--target-first-iteration", type=float, metavar="RATIO",
                        help="target: a GPU run's first iteration within RATIO times its inputs' read time at disk speed")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir)
    try:
        if not workdir.is_dir():
            raise InputError(f"{workdir}: no such directory")
        log_path = Path(args.snakemake_log) if args.snakemake_log else find_snakemake_log(workdir)
        if not log_path.is_file():
            raise InputError(f"{log_path}: no such file")
        run = parse_snakemake_log(log_path.read_text(errors="replace"))
        if not run.jobs:
            raise InputError(f"{log_path}: no job found")
        metadata = read_metadata(workdir / ".snakemake" / "metadata")
        offset = local_offset(run.jobs.values(), metadata)
        refine(run, workdir, metadata, offset)
    except (InputError, OSError) as exc:
        print(f"job_times: error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    opts = Options(
        started=naive(args.started, offset) if args.started is not None else None, total_s=args.total,
        disk_bw=args.disk_bw, disk_note=args.disk_note, target_total=args.target_total,
        target_reference=args.target_reference, target_first_iteration=args.target_first_iteration,
    )
    source = f"{os.path.relpath(log_path, workdir) if log_path.is_relative_to(workdir) else log_path}"
    print("\n".join(report(run, opts, source)))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
