#!/usr/bin/env python3
"""Check, from a workflow run's job logs, that jobs holding GPUs at the same time held disjoint GPUs.

Every GPU job of the workflow (``run_mlem``, ``bench_spmv``) takes its GPUs
with :func:`mlemlib.dist.lease.lease_gpus`, which logs, in the job's log
(format :data:`mlemlib.logs.LOG_FORMAT`)::

    2026-11-23 10:00:01,234 INFO mlemlib.dist.lease: leased GPU(s) 0,1 (PCI 00000000:18:00.0,00000000:2A:00.0; pid 4242; lock dir /tmp/l)
    2026-11-23 10:00:09,876 INFO mlemlib.dist.lease: releasing GPU lease 0,1

(and ``waiting for 2 free GPU(s); busy: 0,1`` when it had to wait). The
"leased" line is written after the locks are taken and the "releasing" line
before they are dropped, so the logged interval lies inside the held one:
two logged intervals that overlap are a real overlap. For every lease this
prints its GPUs and interval, then every pair of leases that overlap in time,
and fails when such a pair shares a GPU (by PCI bus id where both logs give
it, else by ``CUDA_VISIBLE_DEVICES`` entry).

``--apps FILE`` adds what the driver saw: lines ``pid, PCI bus id`` as
``nvidia-smi --query-compute-apps=pid,gpu_bus_id --format=csv,noheader``
prints them, sampled while the workflow ran. A job's process seen on a GPU
outside its lease fails the check. ``--min-concurrent``,
``--max-concurrent``, ``--jobs`` and ``--min-waited`` check how many leases
were held at once and in all, and how many jobs had to wait for free GPUs.

Usage::

    python3 tools/device_workflow/check_leases.py [--apps apps.csv] [--min-concurrent 2] LOGDIR_OR_FILE...

Prints a markdown table and a verdict line (``PASS: ...`` or ``FAIL: ...``).
Exit status: 0 every check passed; 1 a check failed (two leases that overlap
share a GPU, a process seen outside its lease, or a count not as expected);
2 no job log or no lease found, or a bad argument.
"""

from __future__ import annotations

import argparse
import itertools
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

#: Exit statuses.
EXIT_PASS = 0
EXIT_FAIL = 1
EXIT_INPUT = 2

#: A log line of mlemlib.logs.LOG_FORMAT: "2026-11-23 10:00:01,234 INFO name: message".
LINE = re.compile(r"^(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (?P<level>[A-Z]+) (?P<logger>\S+): (?P<msg>.*)$")
TIME_FORMAT = "%Y-%m-%d %H:%M:%S,%f"
#: mlemlib.dist.lease.acquire's line (PCI and pid are absent from older logs).
LEASED = re.compile(
    r"^leased GPU\(s\) (?P<devices>\S+) \((?:PCI (?P<pci>[^;]+); )?(?:pid (?P<pid>\d+); )?lock dir (?P<lock_dir>.*)\)$"
)
#: GpuLease.release's line ("released" in older logs, written after unlocking).
RELEASED = re.compile(r"^releas(?:ing|ed) GPU lease (?P<devices>\S+)$")
WAITING = re.compile(r"^waiting for (?P<count>\d+) free GPU\(s\)")
#: A PCI bus id as NVML and nvidia-smi write it: [domain:]bus:device.function, hexadecimal.
PCI = re.compile(r"^(?:(?P<domain>[0-9A-Fa-f]{1,8}):)?(?P<bus>[0-9A-Fa-f]{1,2}):(?P<dev>[0-9A-Fa-f]{1,2})\.(?P<fn>[0-7])$")


class InputError(ValueError):
    """A log, apps file or argument that cannot be used."""


def normalise_pci(bus_id: str) -> str | None:
    """``"00000000:18:00.0"`` -> ``"0000:18:00.0"`` (one spelling for NVML and nvidia-smi); None if not a bus id."""
    m = PCI.match(bus_id.strip())
    if m is None:
        return None
    domain = int(m["domain"] or "0", 16)
    return f"{domain:04x}:{int(m['bus'], 16):02x}:{int(m['dev'], 16):02x}.{m['fn']}"


@dataclass
class Lease:
    """One lease taken in one job log.

    Attributes
    ----------
    job
        The log it was found in (a path, as given or relative to the directory given).
    devices
        The ``CUDA_VISIBLE_DEVICES`` entries leased.
    pci
        Their normalised PCI bus ids, or None where the log does not give all of them.
    pid
        The leasing process, where the log gives it.
    start, end
        When the lease was logged as taken and as released (``end`` is the
        log's last line where no release was logged; ``released`` says which).
    job_start
        The job log's first timestamp (the job was running from then on).
    waited
        True when the job logged that it had to wait for free GPUs.
    """

    job: str
    devices: tuple[str, ...]
    pci: tuple[str, ...] | None
    pid: int | None
    start: datetime
    end: datetime
    job_start: datetime
    released: bool = False
    waited: bool = False

    def shared_with(self, other: Lease) -> set[str]:
        """GPUs both leases name: by PCI bus id where both give it, else by entry."""
        if self.pci is not None and other.pci is not None:
            return set(self.pci) & set(other.pci)
        return set(self.devices) & set(other.devices)

    def overlap_with(self, other: Lease) -> float:
        """Seconds both leases were held at once (0 if they were not)."""
        return max(0.0, (min(self.end, other.end) - max(self.start, other.start)).total_seconds())


def parse_log(text: str, job: str) -> list[Lease]:
    """The leases in one job log's text.

    Parameters
    ----------
    text
        The log's content.
    job
        Name to give its leases.

    Returns
    -------
    list of Lease
        In the order taken. A lease with no release logged (the job was
        killed, or still runs) ends at the log's last timestamped line.
    """
    leases: list[Lease] = []
    open_leases: list[Lease] = []
    first: datetime | None = None
    last: datetime | None = None
    waited = False
    for raw in text.splitlines():
        m = LINE.match(raw.rstrip("\r"))
        if m is None:  # tracebacks and other continuation lines
            continue
        t = datetime.strptime(m["ts"], TIME_FORMAT)
        first = first or t
        last = t
        msg = m["msg"]
        if WAITING.match(msg):
            waited = True
        elif (lm := LEASED.match(msg)) is not None:
            devices = tuple(e for e in lm["devices"].split(",") if e)
            pci = None
            if lm["pci"]:
                ids = [normalise_pci(b) for b in lm["pci"].split(",")]
                pci = tuple(ids) if all(ids) and len(ids) == len(devices) else None  # type: ignore[arg-type]
            lease = Lease(
                job=job, devices=devices, pci=pci, pid=int(lm["pid"]) if lm["pid"] else None,
                start=t, end=t, job_start=first, waited=waited,
            )
            leases.append(lease)
            open_leases.append(lease)
            waited = False
        elif (rm := RELEASED.match(msg)) is not None:
            devices = tuple(e for e in rm["devices"].split(",") if e)
            for lease in reversed(open_leases):
                if lease.devices == devices:
                    lease.end, lease.released = t, True
                    open_leases.remove(lease)
                    break
    for lease in open_leases:  # killed, or still running: held at least until the last line
        lease.end = last or lease.start
    return leases


def find_logs(paths: Iterable[str | Path]) -> list[tuple[Path, str]]:
    """Every ``*.log`` file under the given directories, and the given files, with a display name.

    Raises
    ------
    InputError
        If a path does not exist.
    """
    out: list[tuple[Path, str]] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += [(f, str(f.relative_to(p))) for f in sorted(p.rglob("*.log")) if f.is_file()]
        elif p.is_file():
            out.append((p, str(p)))
        else:
            raise InputError(f"{p}: no such file or directory")
    return out


def parse_apps(text: str) -> dict[int, set[str]]:
    """``pid -> PCI bus ids`` from sampled ``nvidia-smi --query-compute-apps=pid,gpu_bus_id`` lines.

    Lines that are no ``pid, bus id`` pair (headers, "No running processes
    found", ``[N/A]``) are skipped.
    """
    seen: dict[int, set[str]] = {}
    for raw in text.splitlines():
        fields = [f.strip() for f in raw.split(",")]
        if len(fields) < 2 or not fields[0].isdigit():
            continue
        bus = normalise_pci(fields[1])
        if bus is not None:
            seen.setdefault(int(fields[0]), set()).add(bus)
    return seen


def common_folder(names: Sequence[str]) -> str:
    """The folder all ``names`` lie in, with its trailing ``/`` (``""`` for none), to shorten them."""
    folders = [n.split("/")[:-1] for n in names]
    common: list[str] = []
    for parts in zip(*folders, strict=False):  # up to the shortest
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return "".join(f"{part}/" for part in common)


def max_concurrent(leases: Sequence[Lease]) -> int:
    """Most leases held at the same instant (a release at the instant another starts is no overlap)."""
    events = sorted([(lease.start, 1) for lease in leases] + [(lease.end, -1) for lease in leases], key=lambda e: (e[0], e[1]))
    best = held = 0
    for _, step in events:
        held += step
        best = max(best, held)
    return best


@dataclass
class Report:
    """The outcome of :func:`check`: the tables, the verdict and the exit status."""

    lines: list[str]
    failures: list[str]
    status: int

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def check(
    leases: Sequence[Lease],
    *,
    apps: dict[int, set[str]] | None = None,
    min_concurrent: int | None = None,
    max_concurrent_allowed: int | None = None,
    jobs: int | None = None,
    min_waited: int | None = None,
    logs_without_lease: Sequence[str] = (),
) -> Report:
    """Check the leases and format the report.

    Parameters
    ----------
    leases
        Every lease found (at least one).
    apps
        ``pid -> PCI bus ids`` the driver saw (:func:`parse_apps`), or None.
    min_concurrent, max_concurrent_allowed
        Bounds on :func:`max_concurrent` (None: not checked).
    jobs
        The number of leases expected (None: not checked).
    min_waited
        The least number of jobs that must have waited for free GPUs (None: not checked).
    logs_without_lease
        Names of the logs that held no lease (listed for information).

    Returns
    -------
    Report
    """
    t0 = min(lease.job_start for lease in leases)

    def rel(t: datetime) -> str:
        return f"{(t - t0).total_seconds():.3f}"

    failures: list[str] = []
    order = sorted(leases, key=lambda lease: (lease.start, lease.job))
    prefix = common_folder([lease.job for lease in order])
    name = {id(lease): lease.job[len(prefix):] for lease in order}
    lines = [
        f"GPU leases from {len({lease.job for lease in leases})} job log(s)"
        + (f" under {prefix}" if prefix else "")
        + f"; times in s after {t0:%Y-%m-%d %H:%M:%S}",
        "",
        "| job | GPUs (CUDA_VISIBLE_DEVICES) | PCI bus ids | pid | job start | leased | released | held s | waited "
        "| seen by nvidia-smi on |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    seen_jobs = 0
    for lease in order:
        seen = "-"
        if apps is not None:
            if lease.pid is None:
                seen = "(no pid in log)"
            elif lease.pid not in apps:
                seen = "(not seen)"
            else:
                seen_on = apps[lease.pid]
                seen_jobs += 1
                seen = ",".join(sorted(seen_on))
                outside = seen_on - set(lease.pci or ())
                if lease.pci is None:
                    failures.append(f"{name[id(lease)]}: seen on {seen} but its log gives no PCI bus ids to compare")
                elif outside:
                    failures.append(f"{name[id(lease)]}: pid {lease.pid} seen on {','.join(sorted(outside))}, outside its lease")
        lines.append(
            f"| {name[id(lease)]} | {','.join(lease.devices)} | {','.join(lease.pci) if lease.pci else '?'} | "
            f"{lease.pid if lease.pid is not None else '?'} | {rel(lease.job_start)} | {rel(lease.start)} | "
            f"{rel(lease.end)}{'' if lease.released else ' (no release logged)'} | "
            f"{(lease.end - lease.start).total_seconds():.3f} | "
            f"{f'yes, {(lease.start - lease.job_start).total_seconds():.3f} s' if lease.waited else 'no'} | {seen} |"
        )
    pairs = [(a, b) for a, b in itertools.combinations(order, 2) if a.overlap_with(b) > 0]
    lines += ["", "Leases held at the same time:", ""]
    if pairs:
        lines += ["| job | job | both held s | shared GPUs | |", "|---|---|---|---|---|"]
        for a, b in pairs:
            shared = a.shared_with(b)
            if shared:
                failures.append(f"{name[id(a)]} and {name[id(b)]} held {','.join(sorted(shared))} at the same time")
            lines.append(
                f"| {name[id(a)]} | {name[id(b)]} | {a.overlap_with(b):.3f} | {','.join(sorted(shared)) or 'none'} | "
                f"{'SHARED' if shared else 'disjoint'} |"
            )
    else:
        lines.append("(none: every lease was held alone)")
    running = sum(
        1 for a, b in itertools.combinations(order, 2) if min(a.end, b.end) > max(a.job_start, b.job_start)
    )
    most = max_concurrent(order)
    if min_concurrent is not None and most < min_concurrent:
        failures.append(f"at most {most} lease(s) held at once, expected at least {min_concurrent}")
    if max_concurrent_allowed is not None and most > max_concurrent_allowed:
        failures.append(f"{most} leases held at once, expected at most {max_concurrent_allowed}")
    if jobs is not None and len(order) != jobs:
        failures.append(f"{len(order)} lease(s) found, expected {jobs}")
    waited = sum(lease.waited for lease in order)
    if min_waited is not None and waited < min_waited:
        failures.append(f"{waited} job(s) waited for free GPUs, expected at least {min_waited}")
    unreleased = [name[id(lease)] for lease in order if not lease.released]
    lines += [
        "",
        f"{len(order)} lease(s); at most {most} held at once; {len(pairs)} pair(s) held at the same time; "
        f"{running} pair(s) of jobs ran at the same time; {waited} job(s) waited for free GPUs.",
    ]
    if apps is not None:
        others = {pid: bus for pid, bus in apps.items() if pid not in {lease.pid for lease in order}}
        if others:
            lines.append(
                "Other processes seen on GPUs: "
                + ", ".join(f"pid {pid} on {','.join(sorted(bus))}" for pid, bus in sorted(others.items()))
                + "."
            )
    if unreleased:
        lines.append(f"No release logged (held at least until the log's last line): {', '.join(unreleased)}.")
    if logs_without_lease:
        lines.append(f"Logs without a lease: {len(logs_without_lease)}.")
    if failures:
        lines.append("FAIL: " + "; ".join(failures))
        return Report(lines, failures, EXIT_FAIL)
    lines.append(
        "PASS: "
        + (
            f"{len(pairs)} pair(s) of leases held at the same time, all on disjoint GPUs"
            if pairs
            else f"no two of the {len(order)} lease(s) were held at the same time"
        )
        + (
            f"; {seen_jobs} of {len(order)} job process(es) seen by the driver, each only on its leased GPUs"
            if apps is not None
            else ""
        )
    )
    return Report(lines, failures, EXIT_PASS)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: parse the logs, check, print the report; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="check_leases.py",
        description="Check that jobs holding GPUs at the same time held disjoint GPUs, from their logs.",
        epilog="exit status: 0 pass, 1 a check failed, 2 no job log or lease found, or a bad argument",
    )
    parser.add_argument("paths", nargs="+", metavar="LOGDIR_OR_FILE", help="job logs, or directories searched for *.log")
    parser.add_argument("--apps", metavar="FILE", help="sampled `nvidia-smi --query-compute-apps=pid,gpu_bus_id` lines")
    parser.add_argument("--min-concurrent", type=int, metavar="K", help="fail unless some K leases were held at once")
    parser.add_argument("--max-concurrent", type=int, metavar="K", help="fail if more than K leases were held at once")
    parser.add_argument("--jobs", type=int, metavar="N", help="fail unless exactly N leases were found")
    parser.add_argument("--min-waited", type=int, metavar="K", help="fail unless some K jobs waited for free GPUs")
    args = parser.parse_args(argv)
    try:
        logs = find_logs(args.paths)
        if not logs:
            raise InputError(f"no *.log file under {', '.join(args.paths)}")
        leases: list[Lease] = []
        without: list[str] = []
        for path, name in logs:
            found = parse_log(path.read_text(errors="replace"), name)
            leases += found
            if not found:
                without.append(name)
        if not leases:
            raise InputError(f"no GPU lease in {len(logs)} log(s) under {', '.join(args.paths)}")
        apps = None
        if args.apps is not None:
            apps_path = Path(args.apps)
            if not apps_path.is_file():
                raise InputError(f"{apps_path}: no such file")
            apps = parse_apps(apps_path.read_text(errors="replace"))
    except (InputError, OSError) as exc:
        print(f"check_leases: error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    report = check(
        leases, apps=apps, min_concurrent=args.min_concurrent, max_concurrent_allowed=args.max_concurrent,
        jobs=args.jobs, min_waited=args.min_waited, logs_without_lease=without,
    )
    print(report.text)
    return report.status


if __name__ == "__main__":
    sys.exit(main())
