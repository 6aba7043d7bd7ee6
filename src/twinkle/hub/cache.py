"""Building a cached folder exactly once across processes.

Several ranks often start at the same moment and all want the same converted model. The first
one to take the lock builds the folder into a temporary sibling and renames it into place; the
others wait on the lock, then find the finished folder. A folder counts as present only once it
holds the completion marker, so nobody ever reads half a folder."""

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from twinkle.utils.errors import UserError
from twinkle.utils.fileio import COMPLETE_MARKER, atomic_dir, atomic_write_text, file_lock, is_complete

_FIX = "set TWINKLE_CACHE to a writable folder (the default is ~/.cache/twinkle)"


def check_writable(final: Path) -> None:
    """``final`` can be built: its nearest existing ancestor is a folder this process may write
    in. A ``UserError`` otherwise, before the lock or the build: ``TWINKLE_CACHE`` set to a file,
    or to a folder of another user or on a read-only disk."""
    existing = final
    try:
        while not existing.exists() and existing.parent != existing:
            existing = existing.parent  # below a file, exists() is False up to the file itself
        is_dir = existing.is_dir()
    except OSError as exc:  # a folder above it that this user may not search
        raise UserError(f"cannot build {final} in the Twinkle cache ({exc.strerror}); {_FIX}") from None
    if not is_dir:
        raise UserError(
            f"cannot build {final} in the Twinkle cache: {existing} is a file, not a folder; {_FIX}"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"cannot build {final} in the Twinkle cache: {existing} is not writable; {_FIX}")


def ensure_converted(final: str | os.PathLike, build_fn: Callable[[Path], None]) -> Path:
    """Return ``final``, first building it with ``build_fn(tmp_folder)`` unless it is complete.

    ``build_fn`` writes into an empty temporary folder; the marker is written after it returns
    and the folder is renamed to ``final`` only then. The build runs while holding a lock on a
    sibling ``<final>.lock`` file, and completeness is re-checked after the lock is taken, so
    concurrent callers build once. A failed build leaves no ``final`` behind."""
    final = Path(final)
    if is_complete(final):
        return final
    check_writable(final)
    # ``with_name`` rather than ``with_suffix``: names like ``model.Q4_1-ab12`` have dots.
    with file_lock(final.with_name(final.name + ".lock")):
        if is_complete(final):
            return final
        # We hold the lock, so temporary siblings left behind are from builders that died.
        for stale in final.parent.glob(f".{final.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        with atomic_dir(final) as tmp:
            build_fn(tmp)
            atomic_write_text(tmp / COMPLETE_MARKER, "ok\n")
    return final
