"""Atomic writes and an inter-process lock, so concurrent ranks never see half a file; and
``open_no_follow``, which writes a file without ever following a link to somewhere else.

The folder ``atomic_dir`` builds and the file ``atomic_write_text`` writes end with the
permissions the process's umask gives a plain ``mkdir`` or ``open`` (``tempfile`` creates them
0700 and 0600); what is written inside the folder gets them from ``mkdir`` and ``open`` already."""

import contextlib
import errno
import fcntl
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from twinkle.utils.errors import UserError

# Written last into a folder built in several steps (a converted model, a checkpoint): a folder
# without it was interrupted and counts as absent.
COMPLETE_MARKER = ".twinkle-complete"


def is_complete(folder: str | os.PathLike) -> bool:
    return (Path(folder) / COMPLETE_MARKER).is_file()


def current_umask() -> int:
    """The process's umask, read without changing it where Linux reports it (``/proc``); else
    set and restored at once."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def umask_mode(folder: bool) -> int:
    """The mode a plain ``mkdir`` (``folder``) or ``open`` gives under the process's umask."""
    return (0o777 if folder else 0o666) & ~current_umask()


def open_no_follow(path: str | os.PathLike, mode: str = "w") -> IO[str]:
    """Open ``path`` for text writing (``mode`` "w" truncates, "a" appends) without following
    a symbolic link at its last component, and refuse a file hard-linked elsewhere: a link
    placed there would otherwise have this write change a file outside the folder. Raises
    ``UserError`` naming the link; the link and what it points to are left as they are."""
    if mode not in ("w", "a"):
        raise ValueError(f"open_no_follow: mode must be 'w' or 'a', not {mode!r}")
    path = Path(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    flags |= os.O_APPEND if mode == "a" else 0
    try:
        fd = os.open(path, flags, 0o666)  # O_NONBLOCK: a FIFO there fails (ENXIO) instead of hanging
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):
            raise UserError(refuse_link_message(path)) from None
        if exc.errno in (errno.ENXIO, errno.EISDIR):
            raise UserError(_not_ours(path, "is not a regular file")) from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
        os.close(fd)
        what = "has other hard links" if stat.S_ISREG(info.st_mode) else "is not a regular file"
        raise UserError(_not_ours(path, what))
    os.set_blocking(fd, True)
    if mode == "w":
        os.ftruncate(fd, 0)
    return os.fdopen(fd, mode, encoding="utf-8")


def _not_ours(path: Path, what: str) -> str:
    return f"{path} {what}; Twinkle writes only files of its own there: remove it or choose another folder"


def refuse_link_message(path: str | os.PathLike, other: str = "folder") -> str:
    """One line saying that ``path`` is a link Twinkle will not write through; the fix offers
    to remove it or choose another ``other``."""
    try:
        target = f" (to {os.readlink(path)})"
    except OSError:
        target = ""
    return (
        f"{path} is a symbolic link{target}; Twinkle never writes through a link: remove the link "
        f"or choose another {other}"
    )


@contextlib.contextmanager
def file_lock(path: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the block."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def fsync_tree(folder: str | os.PathLike) -> None:
    """Flush every file under ``folder`` and the folder entries themselves to disk."""
    for root, _dirs, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as handle:
                os.fsync(handle.fileno())
        dir_fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _remove(path: Path) -> None:
    """Remove the folder ``path``; a link there is removed itself, never what it points to."""
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def swap_into_place(tmp: Path, final: Path) -> None:
    """Rename the finished folder ``tmp`` to ``final``; an existing ``final`` is moved aside
    first and removed only once the new one is in place."""
    if final.exists() or final.is_symlink():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        _remove(old)
        os.rename(final, old)
        os.rename(tmp, final)
        _remove(old)
    else:
        os.rename(tmp, final)


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success flush it and rename it to ``final``.

    An existing ``final`` is replaced only after the new folder is complete, so a crash at any
    point leaves either the old folder or the new one, never a torn mix. On error the temporary
    folder is removed and ``final`` is untouched."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        os.chmod(tmp, umask_mode(folder=True))  # mkdtemp made it 0700
        fsync_tree(tmp)
        swap_into_place(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a flushed temporary file and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, umask_mode(folder=False))  # mkstemp made it 0600
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
