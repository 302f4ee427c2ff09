"""Private helpers for writing outputs atomically.

Every writer in mlemlib writes to a temporary name beside the target and renames
it into place only when the content is complete, so an interrupted or failed
write never leaves a file that looks finished.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``target``; rename it to ``target`` on success.

    On any exception the temporary file (or directory) is removed and the
    exception propagates; ``target`` is left untouched.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        if tmp_path.is_file():
            os.chmod(tmp_path, 0o666 & ~_umask())  # mkstemp creates 0600; outputs follow the umask
        os.replace(tmp_path, target)
    except BaseException:
        if tmp_path.is_dir():
            shutil.rmtree(tmp_path, ignore_errors=True)
        else:
            tmp_path.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory beside ``target``; rename it to ``target`` on success.

    An existing ``target`` directory is replaced only once the new one is complete.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        yield tmp_path
        os.chmod(tmp_path, 0o777 & ~_umask())  # mkdtemp creates 0700; outputs follow the umask
        if target.exists():
            old = target.with_name(f".{target.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(target, old)
            os.replace(tmp_path, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp_path, target)
    except BaseException:
        shutil.rmtree(tmp_path, ignore_errors=True)
        raise
