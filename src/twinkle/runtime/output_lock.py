"""One run per output folder: ``<output_dir>/.twinkle.lock``, held with ``flock`` while the run lives.

Which folder: the run configuration's ``output_dir`` when the run owns it
(``RunDefaults.lock_output_dir``, set by the CLI, or by a script's ``initialize(run=...)``).
``initialize()`` takes the lock (``take_for_run``), before the process group forms, in the one
process that owns the folder: rank 0 under torchrun (the other ranks of the job never ask, so they
cannot refuse each other) and the driver under ``--mode ray`` (its workers never ask, so they
cannot wait on it). A library call that only builds a model takes no lock.

A second run into the same folder is refused with one ``UserError`` naming the pid, host and
start time written in the file. The OS drops a ``flock`` when its process dies, however it dies:
a file left by a killed run is simply locked again, and the warning names the run that left it.
A clean exit removes the file. The lock file is never opened through a symbolic link, nor
when it has other hard links (its contents are rewritten): one line refuses the run instead."""

import atexit
import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
from pathlib import Path
from typing import Any

from twinkle.utils.errors import UserError
from twinkle.utils.fileio import refuse_link_message
from twinkle.utils.logger import get_logger

LOCK_FILE = ".twinkle.lock"
_ATTEMPTS = 5  # a holder that removes the file as we open it: lock the new file instead

_held: dict[str, tuple[int, Path, int]] = {}  # real path of the folder -> (fd, lock file, owner pid)
_state: dict[str, Any] = {"exit_hook": False}


def take_for_run(defaults: Any, owner: bool) -> None:
    """Lock ``defaults.output_dir`` when the run owns it and this process owns the folder
    (``owner``: rank 0 of torchrun, a single process, or the Ray driver)."""
    if owner and defaults.lock_output_dir:
        acquire(defaults.output_dir)


def _holder_text(fd: int) -> dict[str, Any]:
    try:
        raw = os.pread(fd, 4096, 0)
        holder = json.loads(raw.decode("utf-8")) if raw.strip() else {}
    except (OSError, ValueError):
        return {}
    if not isinstance(holder, dict) or not isinstance(holder.get("pid"), int):
        return {}
    return holder


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "a process that had not written its pid yet"
    return f"pid {holder['pid']} on host {holder.get('host', '?')}, started {holder.get('started', '?')}"


def _refusal(folder: Path, holder: dict[str, Any]) -> str:
    who = _describe(holder)
    if holder and holder.get("host") == socket.gethostname() and not _alive(holder["pid"]):
        who += "; that pid has ended, but a process it started still holds the file open"
    return (
        f"--output-dir {folder} is in use by another run ({who}); wait for it to end, stop it, "
        "or choose another --output-dir"
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def _same_file(fd: int, path: Path) -> bool:
    try:
        on_disk = os.lstat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (on_disk.st_dev, on_disk.st_ino)


def acquire(output_dir: str | os.PathLike) -> None:
    """Hold the lock of ``output_dir`` (created if missing) until this process ends; a no-op
    when this process holds it already. Raises ``UserError`` when another process holds it."""
    folder = Path(output_dir).expanduser().absolute()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(
            f"cannot create --output-dir {folder} ({exc.strerror}); choose a writable folder"
        ) from exc
    key = os.path.realpath(folder)
    if key in _held:
        return
    path = folder / LOCK_FILE
    logger = get_logger()
    for _ in range(_ATTEMPTS):
        existed = path.exists()
        try:  # never through a link: the lock file is truncated and rewritten below
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EMLINK):
                raise UserError(refuse_link_message(path, "--output-dir")) from None
            raise UserError(f"cannot write {path} ({exc.strerror}); choose a writable --output-dir") from exc
        if os.fstat(fd).st_nlink > 1:
            os.close(fd)
            raise UserError(f"{path} has other hard links; remove it or choose another --output-dir")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder_text(fd)
            os.close(fd)
            raise UserError(_refusal(folder, holder)) from None
        except OSError as exc:  # a file system without locks (ENOLCK, EOPNOTSUPP)
            os.close(fd)
            logger.warning(
                f"cannot lock --output-dir {folder} ({exc.strerror}); a second run into it would not be refused"
            )
            return
        if _same_file(fd, path):
            break
        os.close(fd)  # its holder removed this file as it ended; lock the one now at that path
    else:
        logger.warning(f"could not lock --output-dir {folder}: {path} keeps being replaced")
        return
    previous = _holder_text(fd)
    if previous or existed:
        logger.warning(
            f"--output-dir {folder}: took over the lock file left by {_describe(previous)}, which no longer holds it"
        )
    me = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now().isoformat(sep=" ", timespec="seconds"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(me) + "\n").encode("utf-8"), 0)
    if not _state["exit_hook"]:
        atexit.register(release_all)
        _state["exit_hook"] = True
    _held[key] = (fd, path, os.getpid())


def release_all() -> None:
    """Remove and unlock every lock file this process holds (at exit; a forked child holding an
    inherited copy leaves them alone)."""
    for key, (fd, path, owner) in list(_held.items()):
        if owner == os.getpid():
            # Removed while still locked: a run starting now creates and locks a new file, and
            # one that opened this file just before sees that it was replaced and retries.
            with contextlib.suppress(OSError):
                os.unlink(path)
            with contextlib.suppress(OSError):
                os.close(fd)
        del _held[key]
