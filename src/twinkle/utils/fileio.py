"""Atomic writes and an inter-process lock, so concurrent ranks never see half a file."""

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

# Written last into a folder built in several steps (a converted model, a checkpoint): a folder
# without it was interrupted and counts as absent.
COMPLETE_MARKER = ".twinkle-complete"


def is_complete(folder: str | os.PathLike) -> bool:
    return (Path(folder) / COMPLETE_MARKER).is_file()


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


def swap_into_place(tmp: Path, final: Path) -> None:
    """Rename the finished folder ``tmp`` to ``final``; an existing ``final`` is moved aside
    first and removed only once the new one is in place."""
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
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
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
