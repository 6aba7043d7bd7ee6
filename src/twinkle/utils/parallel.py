"""``PosixFileLock``: an exclusive lock shared by processes through a file (``flock``).

Upstream's call shape: ``PosixFileLock(path)``, then ``acquire()`` / ``release()`` or ``with lock:``;
``close()`` drops the descriptor. The lock is advisory (it binds only processes that take it) and
the OS releases it when its holder dies. A lock that crosses a ``fork`` or a pickle (Ray, a
``datasets`` worker) opens its own descriptor in the new process, so each process holds the lock
for itself."""

import fcntl
import os
from pathlib import Path
from typing import Any, TextIO


class PosixFileLock:
    """Exclusive inter-process lock on ``path`` (created, with its folder, if missing)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._handle: TextIO | None = None
        self._pid = -1
        self._depth = 0  # re-entrant within one process: nested ``with`` blocks release once

    def _file(self) -> TextIO:
        if self._handle is None or self._pid != os.getpid():
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self._handle = open(self.path, "a+")  # noqa: SIM115 - held across acquire/release
            self._pid, self._depth = os.getpid(), 0
        return self._handle

    def acquire(self) -> None:
        """Wait until no other process holds the lock, then hold it."""
        handle = self._file()
        if self._depth == 0:
            fcntl.flock(handle, fcntl.LOCK_EX)
        self._depth += 1

    def release(self) -> None:
        """Let the next process in; a release without an acquire is a mistake and raises."""
        if self._handle is None or self._pid != os.getpid() or self._depth == 0:
            raise RuntimeError(f"PosixFileLock({self.path!r}).release(): the lock is not held")
        self._depth -= 1
        if self._depth == 0:
            fcntl.flock(self._handle, fcntl.LOCK_UN)

    def close(self) -> None:
        """Close the descriptor (which releases a lock still held)."""
        if self._handle is not None and self._pid == os.getpid():
            self._handle.close()
        self._handle, self._depth = None, 0

    def __enter__(self) -> "PosixFileLock":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])

    def __repr__(self) -> str:
        return f"PosixFileLock({self.path!r})"
