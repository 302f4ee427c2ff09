"""Argument helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def existing_file(text: str) -> Path:
    """argparse type: a path that must exist (checked at parse time)."""
    p = Path(text)
    if not p.exists():
        raise argparse.ArgumentTypeError(f"{text}: no such file or directory")
    return p


def factor_file(text: str) -> str:
    """argparse type: a file of per-LOR values (raw float32, or ``file.h5:/dataset``) whose file must exist."""
    from mlemlib.corrections import split_h5

    if not Path(split_h5(text)[0]).is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return text


def add_subset_options(p: argparse.ArgumentParser) -> None:
    """``--subsets S`` and ``--subset-file FILE`` (the OSEM subsets of ``reorder``, ``norm`` and ``reconstruct``)."""
    p.add_argument(
        "--subsets", type=positive_int, default=1, metavar="S",
        help="OSEM subsets (1: MLEM): by projection angle where the matrix knows its scanner, else LOR i in "
        "subset i mod S (default: %(default)s)",
    )
    p.add_argument(
        "--subset-file", type=existing_file, default=None, metavar="FILE",
        help="the subset of every LOR (raw little-endian int32, 0 .. S-1) instead",
    )


def output_file(text: str) -> str:
    """argparse type: a file to write (checked at parse time, before any work).

    The path must not name a directory (or end in a path separator), and its
    nearest existing ancestor must be a directory this process may write in
    (the missing ones between are created when the output is written).
    """
    if not text:
        raise argparse.ArgumentTypeError("empty path; expected a file to write")
    p = Path(text)
    if p.is_dir() or text.endswith(("/", os.sep)):
        raise argparse.ArgumentTypeError(f"{text}: is a directory; expected the name of a file to write")
    parent = p.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: cannot write in {parent} (permission denied)")
    return text


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (digits, optionally grouped with ``_``)."""
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text}: not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be >= 1")
    return value


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show ``(default: X)`` where there is a default to show: not for None or
    False, nor where the help text already says what happens by default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False) or "(default" in text:
            return text
        return super()._get_help_string(action)


def add_parser(sub, name: str, help: str, **kw) -> argparse.ArgumentParser:
    """Add a subcommand parser that shows defaults in ``--help``."""
    return sub.add_parser(name, help=help, description=help, formatter_class=_DefaultsFormatter, **kw)


def add_stream_options(
    p: argparse.ArgumentParser,
    *,
    chunk_help: str = "non-zeros per streamed row chunk (about 8*N bytes)",
    threads_help: str = "CPU threads (None: all cores)",
) -> None:
    """``-t/--threads`` and ``-c/--chunk-nnz``: the options of every stage that streams the matrix."""
    from mlemlib.transpose import DEFAULT_CHUNK_NNZ

    p.add_argument("-t", "--threads", type=positive_int, default=None, metavar="N", help=threads_help)
    p.add_argument(
        "-c", "--chunk-nnz", type=positive_int, default=DEFAULT_CHUNK_NNZ, metavar="N", help=chunk_help
    )
