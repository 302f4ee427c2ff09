"""Where a job's set-up time goes: seconds per phase and the bytes read (host side; every backend).

One :class:`SetupTimes` records one set-up. :func:`recording` makes it the
active recorder for a block: :func:`mlemlib.mlem.reconstruct` records the
problem's loading and the backend's construction with one, and a backend's
constructor joins the active recorder (or records with its own where none is
active). The code that does the work marks it with :func:`phase` (or
:func:`timed` on a whole function): the readers (``open``, ``read`` with the
bytes read, ``check``, ``decode``), the uploads (``wait_read``, ``to_gpu``,
``encode``, ``chunk``), the kernels' compilation (``compile``), the
launch-shape tuning (``tune``), the warm-up iteration (``warm_up``), graph
capture (``graph``) and the rest of :data:`PHASES`. Without an active
recorder a phase records nothing and costs a function call.

A phase's seconds are exclusive: a phase inside another (a compilation
during the tuning, a read while a sample is chunked) is taken out of the outer
one, so the phases of the thread that runs the set-up, plus ``other``, add up
to the set-up's wall time. Phases on other threads (the read-ahead of a
streamed upload reads block k + 1 while block k is copied) are kept apart,
under ``background``: they overlap the set-up thread's phases.

A phase of device work (``device=True``) synchronises the current GPU
(``cupy.cuda.Device().synchronize()``) where it starts and where it ends, and
only while a recorder is active: at set-up's phase boundaries, never inside
an iteration.

Wiring a backend (as :class:`mlemlib.backends.cuda.CudaBackend` does)::

    @setup_times.records                        # records __init__ (joining reconstruct's recorder), keeps
    def __init__(self, ...):                    # self.setup_record and logs "set-up 12.3 s: read 7.7 GB ..."
        ...                                     # uploads, tuning and compilation record themselves
        with setup_times.phase("warm_up", device=True):
            self._warm_up()

    def describe(self):
        return {..., "setup": self.setup_record}
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

log = logging.getLogger(__name__)

#: The phases in the order a set-up runs them, with their words in :meth:`SetupTimes.line`.
PHASES: dict[str, str] = {
    "init": "CuPy and CUDA context",
    "open": "open",
    "problem": "problem",  # the measurement, the norm, the fingerprint, the reference
    "read": "read",
    "check": "checks",
    "decode": "decode",
    "encode": "encode",
    "wait_read": "waiting for reads",
    "to_gpu": "to GPU",
    "sample": "chunk sample",
    "chunk": "chunking",
    "transpose": "transpose",
    "layout": "row layout",
    "plan": "smem plan",
    "compile": "compile",
    "tune": "tune",
    "comms": "NCCL communicators",
    "warm_up": "warm-up",
    "graph": "graph capture",
}

#: Phases shorter than this (seconds, all threads together) are left out of :meth:`SetupTimes.line`.
LINE_MIN_SECONDS = 0.005

F = TypeVar("F", bound=Callable[..., Any])


def _device_synchronize() -> None:
    import cupy

    cupy.cuda.Device().synchronize()


def ordered(names: Any) -> list[str]:
    """Phase names in :data:`PHASES` order, unknown ones after, sorted."""
    names = set(names)
    return [p for p in PHASES if p in names] + sorted(names - set(PHASES))


class SetupTimes:
    """Seconds per set-up phase (exclusive of the phases nested in it) and the bytes read.

    Parameters
    ----------
    clock
        Seconds (default :func:`time.perf_counter`).
    sync
        What a ``device=True`` phase calls at its ends (default: synchronise
        the current GPU).

    Attributes
    ----------
    seconds
        Phase -> seconds on the thread that made the recorder.
    background
        Phase -> seconds on other threads (overlapping ``seconds``).
    read_bytes
        Bytes read by ``read`` phases, on every thread.
    """

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter,
                 sync: Callable[[], None] | None = None) -> None:
        self._clock = clock
        self._sync = sync if sync is not None else _device_synchronize
        self._lock = threading.Lock()
        self._local = threading.local()
        self._owner = threading.get_ident()
        self.started = clock()
        self.ended: float | None = None
        self.seconds: dict[str, float] = {}
        self.background: dict[str, float] = {}
        self.read_bytes = 0

    def _stack(self) -> list[list[float]]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    @contextlib.contextmanager
    def phase(self, name: str, *, device: bool = False, nbytes: int = 0) -> Iterator[None]:
        """Time the block as phase ``name`` (less the phases nested in it); ``nbytes`` read where it ends
        without an exception; ``device``: synchronise the current GPU where it starts and ends."""
        stack = self._stack()
        if device:
            self._sync()  # earlier work belongs to the phase around this one
        nested = [0.0]
        stack.append(nested)
        t0 = self._clock()
        done = False
        try:
            yield
            done = True
        finally:
            if device and done:
                self._sync()
            elapsed = self._clock() - t0
            stack.pop()
            if stack:
                stack[-1][0] += elapsed
            self.add(name, elapsed - nested[0], nbytes if done else 0)

    def add(self, name: str, seconds: float, nbytes: int = 0) -> None:
        """Add ``seconds`` to phase ``name`` (of this thread) and ``nbytes`` to :attr:`read_bytes`."""
        mine = threading.get_ident() == self._owner
        with self._lock:
            into = self.seconds if mine else self.background
            into[name] = into.get(name, 0.0) + max(0.0, float(seconds))
            self.read_bytes += int(nbytes)

    def finish(self) -> None:
        """Stop the set-up's clock (:attr:`total` stays what it is now)."""
        if self.ended is None:
            self.ended = self._clock()

    @property
    def total(self) -> float:
        """Seconds from the recorder's start to :meth:`finish` (or to now)."""
        return (self.ended if self.ended is not None else self._clock()) - self.started

    def as_dict(self) -> dict[str, Any]:
        """Seconds per phase (:data:`PHASES` order), ``other`` (the rest of the set-up thread's time),
        ``total``, ``read_bytes`` and, where other threads worked, ``background`` (seconds per phase)."""
        with self._lock:
            seconds, background, nbytes = dict(self.seconds), dict(self.background), self.read_bytes
        total = self.total
        out: dict[str, Any] = {p: round(seconds[p], 6) for p in ordered(seconds)}
        out["other"] = round(max(0.0, total - sum(seconds.values())), 6)
        out["total"] = round(total, 6)
        out["read_bytes"] = int(nbytes)
        if background:
            out["background"] = {p: round(background[p], 6) for p in ordered(background)}
        return out

    def line(self) -> str:
        """One line: ``set-up 12.3 s: read 7.7 GB in 9.1 s (0.85 GB/s), to GPU 1.2 s, tune 0.8 s, ..., other 0.3 s``.

        A phase that also ran on other threads says how much of it did
        (``checks 3.0 s (2.9 s of it in the background)``); the read rate is
        the bytes read over the seconds of every thread's reads.
        """
        return format_line(self.as_dict())


def format_line(setup: dict[str, Any]) -> str:
    """:meth:`SetupTimes.line` of a recorded :meth:`SetupTimes.as_dict` (e.g. from ``timings.json``)."""
    background = setup.get("background") or {}
    skip = {"other", "total", "read_bytes", "background"}
    names = ordered((set(setup) - skip) | set(background))
    parts = []
    for name in names:
        own, behind = float(setup.get(name, 0.0)), float(background.get(name, 0.0))
        both = own + behind
        if both < LINE_MIN_SECONDS and not (name == "read" and setup.get("read_bytes")):
            continue
        words = PHASES.get(name, name)
        extra = []
        if name == "read" and setup.get("read_bytes"):
            nbytes = int(setup["read_bytes"])
            text = f"{words} {_size(nbytes)} in {_seconds(both)}"
            if both > 0:
                extra.append(f"{nbytes / both / 1e9:.2f} GB/s")
        else:
            text = f"{words} {_seconds(both)}"
        if behind >= LINE_MIN_SECONDS:
            extra.append(f"{_seconds(behind)} of it in the background")
        parts.append(text + (f" ({'; '.join(extra)})" if extra else ""))
    parts.append(f"other {_seconds(float(setup.get('other', 0.0)))}")
    return f"set-up {_seconds(float(setup.get('total', 0.0)))}: " + ", ".join(parts)


def _seconds(s: float) -> str:
    return f"{s:.2f} s" if s < 10 else f"{s:.1f} s"


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


# --------------------------------------------------------------------------- the active recorder
_ACTIVE: list[SetupTimes] = []
_ACTIVE_LOCK = threading.Lock()


def active() -> SetupTimes | None:
    """The recorder the phases record into now (the innermost :func:`recording`), or None."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def recording(rec: SetupTimes | None = None) -> Iterator[SetupTimes]:
    """Make ``rec`` the active recorder for the block, and finish it where the block ends.

    Without ``rec``: the active recorder where there is one (joined, not
    finished here: the set-up it times goes on), else a new one.
    """
    if rec is None:
        current = active()
        if current is not None:
            yield current
            return
        rec = SetupTimes()
    with _ACTIVE_LOCK:
        _ACTIVE.append(rec)
    try:
        yield rec
    finally:
        with _ACTIVE_LOCK:
            _ACTIVE.remove(rec)
        rec.finish()


def phase(name: str, *, device: bool = False, nbytes: int = 0) -> contextlib.AbstractContextManager[None]:
    """The active recorder's :meth:`SetupTimes.phase`; a context that does nothing where none is active."""
    rec = active()
    if rec is None:
        return contextlib.nullcontext()
    return rec.phase(name, device=device, nbytes=nbytes)


def records(init: F) -> F:
    """Decorate a backend's ``__init__``: its set-up is recorded (:func:`recording`: joining the active
    recorder, else a new one), the record kept as ``self.setup_record`` (:meth:`SetupTimes.as_dict`, for
    ``describe()["setup"]``) and logged at INFO in one line (:meth:`SetupTimes.line`) where it ends."""
    @functools.wraps(init)
    def run(self: Any, *args: Any, **kwargs: Any) -> None:
        with recording() as rec:
            init(self, *args, **kwargs)
            self.setup_record = rec.as_dict()
        log.info("%s backend: %s", getattr(self, "name", type(self).__name__), format_line(self.setup_record))
    return run  # type: ignore[return-value]


def timed(name: str) -> Callable[[F], F]:
    """Decorate a function so that each call is phase ``name`` of the active recorder (if any)."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            rec = active()
            if rec is None:
                return fn(*args, **kwargs)
            with rec.phase(name):
                return fn(*args, **kwargs)
        return run  # type: ignore[return-value]
    return wrap


# --------------------------------------------------------------------------- the process's age
_IMPORTED = time.monotonic()


def process_age() -> float:
    """Seconds since this process started (Linux: from ``/proc``; elsewhere since this module was imported)."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        # fields after the command's closing parenthesis start at field 3; field 22 is the start in clock ticks
        ticks = int(stat.rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED
