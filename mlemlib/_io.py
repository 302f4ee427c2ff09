"""Private I/O helpers: writing outputs atomically, reading ahead.

Every writer in mlemlib writes to a temporary name beside the target and renames
it into place only when the content is complete, so an interrupted or failed
write never leaves a file that looks finished.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh temporary path beside ``target`` (no file there yet); rename it to ``target`` on success.

    On any exception the temporary file (or directory) is removed and the
    exception propagates; ``target`` is left untouched.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    # The caller creates the file: on ext4, closing a file opened with O_TRUNC (h5py's "w", open "wb")
    # starts the writeback of everything written (auto_da_alloc) and waits for it; a new file closes at once.
    tmp_path.unlink()
    try:
        yield tmp_path
        if tmp_path.is_file():
            os.chmod(tmp_path, 0o666 & ~_umask())  # outputs follow the umask, whatever created the file
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


def prefetched(read: Callable[[Any], Any], items: Iterable[Any]) -> Iterator[Any]:
    """``read(item)`` for each item in order, item k + 1 read on a helper thread while item k is used."""
    items = list(items)
    if not items:
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="read-ahead") as pool:
        pending = pool.submit(read, items[0])
        for nxt in items[1:]:
            got = pending.result()
            pending = pool.submit(read, nxt)
            yield got
        yield pending.result()
