"""The folder ``twinkle export`` writes, and which existing folder it may replace.

Every export leaves ``.twinkle-export`` in its folder: JSON naming the checkpoint and base it came
from and every file the export wrote. ``--overwrite`` replaces only a folder that holds this
marker and nothing besides the files it lists, so a folder of the user's own files (the current
folder, a home folder, a project) is never deleted; an empty folder may always be written. The
folder the shell is in (or one holding it) is never replaced, as the shell would be left in a
deleted folder; nor is a symbolic link, whose target the swap would not touch but whose place it
would take."""

import json
import os
from pathlib import Path
from typing import Any

from twinkle.utils.errors import UserError

EXPORT_MARKER = ".twinkle-export"
WRITTEN_BY = "twinkle export"
_SHOWN = 3  # how many of the files an export did not write a message names


def written_files(folder: Path) -> list[str]:
    """Every file under ``folder``, relative and sorted (links count as files)."""
    found = []
    for root, _dirs, files in os.walk(folder):
        found += [os.path.relpath(os.path.join(root, name), folder) for name in files]
    return sorted(found)


def write_marker(folder: Path, info: dict[str, Any]) -> None:
    """Write ``EXPORT_MARKER`` into the finished export ``folder``: ``info`` plus the files."""
    record = {"written_by": WRITTEN_BY, **info, "files": written_files(folder)}
    (folder / EXPORT_MARKER).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The marker of an export folder, or None where there is none or it is not one an export wrote."""
    try:
        record = json.loads((folder / EXPORT_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ok = isinstance(record, dict) and record.get("written_by") == WRITTEN_BY
    return record if ok and isinstance(record.get("files"), list) else None


def _foreign_files(folder: Path, listed: set[str]) -> list[str]:
    """Up to a few files under ``folder`` that neither the marker lists nor are the marker."""
    foreign = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            rel = os.path.relpath(os.path.join(root, name), folder)
            if rel != EXPORT_MARKER and rel not in listed:
                foreign.append(rel)
                if len(foreign) == _SHOWN:
                    return foreign
    return foreign


def _holds_cwd(output: Path) -> bool:
    try:
        cwd = Path(os.path.realpath(os.getcwd()))
    except OSError:
        return False
    return cwd.is_relative_to(os.path.realpath(output))


def check_output(output: Path, given: str, overwrite: bool) -> None:
    """Raise ``UserError`` unless ``output`` is new, an empty folder, or (with ``overwrite``) a
    folder an earlier export wrote that holds nothing else."""
    if output.is_symlink():
        raise UserError(
            f"--output {given} is a symbolic link (to {os.readlink(output)}); pass a real folder, "
            "e.g. the one it points to"
        )
    if output.exists() and not output.is_dir():
        raise UserError(f"--output {given} is a file; choose a folder")
    if output.is_dir() and any(output.iterdir()):
        record = read_marker(output)
        if record is None and not overwrite:
            raise UserError(
                f"--output {given} exists and is not empty; choose an empty or new folder "
                "(--overwrite replaces only a folder twinkle export wrote)"
            )
        if record is None:
            raise UserError(
                f"--output {given} is not a folder twinkle export wrote (no {EXPORT_MARKER}); "
                "choose an empty or new folder"
            )
        if not overwrite:
            raise UserError(
                f"--output {given} exists and is not empty (an earlier export); pass --overwrite "
                "to replace it, or choose another folder"
            )
        foreign = _foreign_files(output, set(record["files"]))
        if foreign:
            raise UserError(
                f"--output {given} holds files twinkle export did not write ({', '.join(foreign)}); "
                "move them out or choose another folder"
            )
    if output.exists() and _holds_cwd(output):
        raise UserError(
            f"--output {given} is the current folder or holds it, and an export replaces its "
            "folder; run twinkle export from another folder or choose another --output"
        )
