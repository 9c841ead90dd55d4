"""Crash-safe replacement of files and of whole directories (final weights, converted models).

**Files** (:func:`write_atomically`): written under a temporary name beside the target, flushed
and fsynced, renamed over the target, and the directory fsynced: a reader sees the old file or
the new one, whole.

**Directories** (:func:`staging_dir`, :func:`swap_in`): the new contents are written into
``TARGET.tmp-<token>`` beside ``TARGET`` (each file fsynced, then the directory), then swapped
in, then the parent directory is fsynced and the old contents removed:

* where the kernel and the filesystem support it (Linux ``renameat2(RENAME_EXCHANGE)``: ext4,
  xfs, btrfs, tmpfs, ...), the two directories trade names in one atomic step: ``TARGET`` is at
  every instant the complete old or the complete new set;
* elsewhere ``TARGET`` is renamed aside to ``TARGET.old-<token>``, then the new directory to
  ``TARGET``. Between these two renames ``TARGET`` does not exist, and the aside is the complete
  old set (it was ``TARGET`` a moment before): :func:`readable` gives readers the aside while
  ``TARGET`` is missing, and :func:`recover` renames it back.

``TARGET.tmp-*`` is never read (it is complete only once swapped in); ``TARGET.old-*`` only while
``TARGET`` is missing. :func:`cleanup`, at the start of the next write of ``TARGET``, recovers a
missing ``TARGET`` from its aside and removes every leftover ``TARGET.tmp-*`` and ``TARGET.old-*``
of an interrupted earlier write. One writer per target at a time (a run writes its own
``final/``; one ``convert`` per ``--out``).

``MESHTRAIN_TEST_SAVE_DELAY_S`` (test-only) holds :func:`swap_in` that many seconds between the
written set and the swap, so a test can kill a process there on purpose.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

TMP = ".tmp-"
"""``TARGET.tmp-<token>``: a new set being written."""
OLD = ".old-"
"""``TARGET.old-<token>``: the previous set, renamed aside during a swap."""
DELAY_ENV = "MESHTRAIN_TEST_SAVE_DELAY_S"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def token() -> str:
    """A name part unique to this moment and process; later tokens sort after earlier ones."""
    return f"{time.time_ns():020d}-{os.getpid()}"


def fsync_dir(path: str | Path) -> None:
    """Flush ``path``'s directory entries (creations, renames, removals) to disk."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as error:  # some filesystems cannot sync a directory: nothing to do there
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def write_atomically(path: str | Path, data: str | bytes) -> None:
    """Replace ``path`` by ``data`` through a fsynced temporary file renamed over it."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}{TMP}{token()}")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data.encode() if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def _leftovers(target: Path, marker: str) -> list[Path]:
    """``TARGET<marker>*`` beside ``target``, oldest first."""
    if not target.parent.is_dir():
        return []
    prefix = target.name + marker
    return sorted(p for p in target.parent.iterdir() if p.name.startswith(prefix))


Check = Callable[[Path], bool]
"""Whether a directory holds a complete set (an aside is one by construction; this guards
against one that something else emptied)."""


def readable(target: str | Path, complete: Check = Path.is_dir) -> Path | None:
    """Where ``target``'s current set is: ``target`` itself when it exists, else (a write was
    interrupted between its two renames) the newest complete aside, else None."""
    target = Path(target)
    if target.exists():
        return target
    asides = [p for p in _leftovers(target, OLD) if complete(p)]
    return asides[-1] if asides else None


def recover(target: str | Path, complete: Check = Path.is_dir) -> bool:
    """If ``target`` is missing but a complete aside exists, rename it back; True if it did."""
    target = Path(target)
    if target.exists() or target.is_symlink():
        return False
    aside = readable(target, complete)
    if aside is None:
        return False
    os.rename(aside, target)
    fsync_dir(target.parent)
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def cleanup(target: str | Path, complete: Check = Path.is_dir) -> None:
    """Before writing ``target`` anew: :func:`recover` it, then remove every leftover
    ``TARGET.tmp-*`` and ``TARGET.old-*`` (no write of ``target`` is running)."""
    target = Path(target)
    recover(target, complete)
    for leftover in _leftovers(target, TMP) + _leftovers(target, OLD):
        _remove(leftover)


def staging_dir(target: str | Path) -> Path:
    """A new, empty ``TARGET.tmp-<token>`` beside ``target`` to write the new set into."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    path = target.with_name(f"{target.name}{TMP}{token()}")
    path.mkdir()
    return path


def _exchange(a: Path, b: Path) -> bool:
    """Atomically trade the names ``a`` and ``b`` (both exist); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a C library without renameat2 (glibc < 2.28, musl)
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    # Any failure (EINVAL: the filesystem lacks the flag; ENOSYS: the kernel lacks the call)
    # falls back to two renames, which raise the error themselves if it is a real one.
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b),
                     _RENAME_EXCHANGE) == 0


def swap_in(new: str | Path, target: str | Path) -> None:
    """Make the complete directory ``new`` (a :func:`staging_dir` of ``target``) be ``target``
    (see the module docstring), fsync the parent, then remove the old set."""
    new, target = Path(new), Path(target)
    fsync_dir(new)
    delay = os.environ.get(DELAY_ENV)  # test-only: widen the crash window before the swap
    if delay:
        time.sleep(float(delay))
    if not (target.exists() or target.is_symlink()):
        os.rename(new, target)
        fsync_dir(target.parent)
        return
    if _exchange(new, target):
        fsync_dir(target.parent)
        _remove(new)  # now the old set
        return
    aside = target.with_name(target.name + OLD + new.name.rpartition(TMP)[2])
    os.rename(target, aside)
    try:
        os.rename(new, target)
    except BaseException:
        os.rename(aside, target)  # the old set back in place
        raise
    fsync_dir(target.parent)
    _remove(aside)
