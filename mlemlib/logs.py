"""Logging set-up shared by the ``mlem`` command and the workflow's scripts (all backends)."""

from __future__ import annotations

import logging
import os
import sys

#: One format for every log line mlemlib writes.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def send_to_log(path: str | os.PathLike, level: int = logging.INFO) -> None:
    """Send stderr and every logger to ``path`` (a Snakemake rule's ``log:``), line-buffered.

    Called first by each workflow script so that tracebacks land in the log too.
    """
    sys.stderr = open(path, "w", buffering=1)  # noqa: SIM115 - lives as long as the job
    logging.basicConfig(stream=sys.stderr, level=level, format=LOG_FORMAT, force=True)
