"""The ``mlem`` command line: one subcommand per workflow stage.

Each subcommand lives in its own module of this package and exposes
``register(subparsers)``, which adds its parser and sets ``func`` (a callable
taking the parsed arguments and returning an exit status).

Exit statuses: 0 success, 1 any other failure, 2 bad input or configuration
(one line ``mlem: error: <file>: <fault>`` on stderr).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import os
import sys

from mlemlib import __version__
from mlemlib.errors import EXIT_FAILURE, EXIT_INPUT, InputError, MlemError, os_error_words
from mlemlib.logs import LOG_FORMAT

#: Subcommand modules, in the order ``--help`` lists them (DAG order).
SUBCOMMANDS = (
    "generate",
    "convert",
    "info",
    "fold",
    "reorder",
    "norm",
    "transpose",
    "partition",
    "chunk",
    "simulate",
    "reconstruct",
    "convergence",
    "summarize",
    "bench",
    "kernels",
    "lease",
)

EPILOG = """exit status:
  0  success
  1  any other failure
  2  bad input or configuration (one line: mlem: error: <file>: <fault>)
"""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line: ``mlem: error: <fault>`` (exit 2)."""

    def error(self, message: str):  # noqa: D102 - argparse API
        self.exit(EXIT_INPUT, f"mlem: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """Build the ``mlem`` argument parser with every subcommand registered."""
    parser = _Parser(
        prog="mlem",
        description="MLEM reconstruction with a stored PET system matrix, on CPUs and 1..N GPUs.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv: debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"mlemlib.cli.{name}").register(sub)
    return parser


#: errnos of a write the disk refused. HDF5 may then hold a file it could not flush; it tries again when
#: the interpreter ends and crashes there (a segmentation fault after the error line), so :func:`run` ends
#: the process without that teardown.
REFUSED_WRITE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_refused_write = False  # set by main() when it reported such an error


def main(argv: list[str] | None = None) -> int:
    """Run the ``mlem`` command; return its exit status."""
    global _refused_write
    _refused_write = False
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose + 1, 2)  # INFO by default, DEBUG with -v
    logging.basicConfig(level=level, format=LOG_FORMAT)
    try:
        return int(args.func(args) or 0)
    except InputError as exc:
        print(f"mlem: error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    except MlemError as exc:
        print(f"mlem: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("mlem: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:  # a full disk, a file too large, permissions: one line, not a traceback
        print(f"mlem: error: {os_error_line(exc)}", file=sys.stderr)
        _refused_write = exc.errno in REFUSED_WRITE
        return EXIT_FAILURE


def run() -> None:
    """The ``mlem`` command (console script, ``python -m mlemlib``): :func:`main`, then exit with its status.

    After a write the disk refused (:data:`REFUSED_WRITE`) the process ends at once (``os._exit``, its
    output and logs flushed first): the interpreter's teardown would hand HDF5 the abandoned file to
    flush again, and HDF5 crashes on it. The temporary file is already gone; nothing else is lost.
    """
    code = main()
    if _refused_write:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def os_error_line(exc: OSError) -> str:
    """One line for an OSError: its file (if it names one) and :func:`~mlemlib.errors.os_error_words`."""
    what = os_error_words(exc)
    return f"{exc.filename}: {what}" if exc.filename else what


if __name__ == "__main__":
    run()
