"""File modes that follow the process umask, for files and directories written through ``tempfile``.

``tempfile.mkstemp`` creates files with mode 0600 and ``tempfile.mkdtemp`` directories with mode 0700, whatever the
umask, because a temporary file is private by design. Our atomic writers create the result in such a temporary and
rename it into place, so without a fix the final file or checkpoint directory stays private (0600 / 0700) where a
plain ``open`` or ``save_pretrained`` would give 0644 / 0755 under the usual umask 022. :func:`follow_umask` sets the
mode a plain write would have given; :func:`atomic_write` does both steps for one file.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

__all__ = ["atomic_write", "current_umask", "follow_umask"]

_UMASK_LOCK = threading.Lock()


def current_umask() -> int:
    """The process umask, read without changing it where the OS allows (Linux: ``/proc/self/status``).

    Elsewhere the only portable way is ``os.umask(0)`` followed by restoring the old value; another thread creating
    a file in between would get mode bits from umask 0. The lock only serialises our own readers, so that window
    remains for foreign threads; it is a few instructions long and only hit off Linux.
    """
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0)
        os.umask(mask)
    return mask


def follow_umask(path: str | os.PathLike, *, recursive: bool = False) -> None:
    """Give ``path`` the mode a plain create would: ``0o666 & ~umask`` for files, ``0o777 & ~umask`` for directories.

    Args:
        path: A file or directory, typically made by ``tempfile.mkstemp`` / ``mkdtemp`` (0600 / 0700).
        recursive: For a directory, also everything below it (symbolic links are left alone).
    """
    mask = current_umask()
    file_mode, dir_mode = 0o666 & ~mask, 0o777 & ~mask
    root = Path(path)
    if root.is_dir() and recursive:
        for folder, dirs, files in os.walk(root):
            for name in dirs:
                if not os.path.islink(os.path.join(folder, name)):
                    os.chmod(os.path.join(folder, name), dir_mode)
            for name in files:
                if not os.path.islink(os.path.join(folder, name)):
                    os.chmod(os.path.join(folder, name), file_mode)
    os.chmod(root, dir_mode if root.is_dir() else file_mode)


def atomic_write(path: str | os.PathLike, write: Callable[[str], object]) -> None:
    """Write ``path`` through a temporary file in the same folder and rename it into place, so no half-written file
    is ever left; the result has the mode a plain create would give (:func:`follow_umask`).

    Args:
        path: The file to (re)write; its folder is created if missing.
        write: Called with the temporary file's path; writes the whole content there.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        follow_umask(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
