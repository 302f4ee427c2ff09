"""Exceptions of mlemlib.

Every error caused by bad input (a corrupt file, a wrong size, a config that does
not validate) is an :class:`InputError`: its message names the file (or config
key) and the fault, and the command line prints it on one line and exits with
:data:`EXIT_INPUT`.
"""

from __future__ import annotations

import os

EXIT_OK = 0
EXIT_FAILURE = 1  # anything else: a bug, an out-of-memory, a CUDA fault
EXIT_INPUT = 2  # bad input or configuration


def os_error_words(exc: OSError) -> str:
    """The system's words for an OSError's errno, else the first line of its message (h5py's own
    messages run over several lines)."""
    return os.strerror(exc.errno) if exc.errno else str(exc).splitlines()[0]


class MlemError(Exception):
    """Base class of every error mlemlib raises on purpose."""


class InputError(MlemError, ValueError):
    """Bad input: names the file (or config key) and the fault.

    Parameters
    ----------
    source
        The file path or config key at fault.
    fault
        What was found and what was expected.
    """

    def __init__(self, source: str | os.PathLike, fault: str) -> None:
        self.source = os.fspath(source)
        self.fault = fault
        super().__init__(f"{self.source}: {fault}")


class MatrixFormatError(InputError):
    """A system-matrix file (.csr4, .mtx, .npz, .h5) is malformed or inconsistent."""


class SinogramFormatError(InputError):
    """A measurement file (.LMsino) is malformed or disagrees with the matrix."""


class ConfigError(InputError):
    """A configuration value does not validate."""


class DeviceError(MlemError):
    """A GPU is missing, too small, or CuPy is not installed."""
