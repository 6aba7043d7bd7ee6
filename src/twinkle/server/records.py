"""The server's own records on disk, read back at start-up: parsing and validating ``run.json``,
``checkpoints.json`` and the ``.jsonl`` id files, and moving a damaged one under
``output_dir/damaged/`` (the same relative path) with one warning, so every other tenant comes
back (``twinkle.server.state.Registry`` reads through these). Nothing is deleted; ``damaged/`` is
never read back. Also the file-system checks the registry shares: a writable output folder, a
folder that is not a link, flushing a folder's entries."""

import contextlib
import json
import os
from collections.abc import Callable, Container
from pathlib import Path
from typing import Any

from twinkle.utils.errors import UserError
from twinkle.utils.fileio import atomic_write_text
from twinkle.utils.logger import get_logger

KINDS = {"weights": "training", "sampler_weights": "sampler"}
DAMAGED = "damaged"  # output_dir/damaged: records moved aside at start-up, never read back
PERSISTED = ("id", "tenant", "base_model", "rank", "created", "last_request", "adapter")
TYPES: dict[str, tuple[type, ...]] = {
    "id": (str,),
    "tenant": (str,),
    "base_model": (str,),
    "rank": (int,),
    "created": (int, float),
    "last_request": (int, float),
    "adapter": (str,),
}


logger = get_logger(__name__)


def check_output_dir(root: Path) -> None:
    """``root`` exists (made if missing) and takes new files; else ``UserError`` in one line."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".twinkle-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        what = (
            "is not a folder" if root.exists() and not root.is_dir() else f"is not writable ({exc.strerror})"
        )
        raise UserError(f"--output-dir {root} {what}; pass a folder this process can write to") from None


def kind_ok(value: Any, kinds: tuple[type, ...]) -> bool:
    return isinstance(value, kinds) and not isinstance(value, bool)


def fsync_dir(folder: Path) -> None:
    """Flush the folder's entries (a rename in it) to disk, where the system allows it."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def real_dir(path: Path) -> bool:
    """A folder, not a link to one."""
    return not path.is_symlink() and path.is_dir()


def parse_json(raw: bytes) -> Any:
    """The JSON value of ``raw``; ``ValueError`` saying why not."""
    if not raw.strip():
        raise ValueError("empty")
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None


def parse_notes(raw: bytes) -> dict[str, dict[str, Any]]:
    """A ``checkpoints.json``: ``{"<kind>/<name>": {"expires_at": number, "user_metadata": {...},
    "public": true}}``."""
    notes = parse_json(raw)
    if not isinstance(notes, dict):
        raise ValueError(f"a JSON {type(notes).__name__}, not an object")
    for key, entry in notes.items():
        kind, _, name = key.partition("/")
        if kind not in KINDS or not name or not isinstance(entry, dict):
            raise ValueError(f"entry {key!r} is not a checkpoint's notes")
        if "expires_at" in entry and not kind_ok(entry["expires_at"], (int, float)):
            raise ValueError(f"entry {key!r}: expires_at is not a number")
        if "user_metadata" in entry and not isinstance(entry["user_metadata"], dict):
            raise ValueError(f"entry {key!r}: user_metadata is not an object")
        if "public" in entry and entry["public"] is not True:
            raise ValueError(f"entry {key!r}: public is not true")
    return notes


def client_record(record: Any) -> bool:
    return isinstance(record, dict) and isinstance(record.get("id"), str)


def sampler_record(record: Any) -> bool:
    return client_record(record) and "path" in record and isinstance(record["path"], str | None)


def read_run(root: Path, folder: Path, taken: Container[str]) -> dict[str, Any] | None:
    """The fields of ``folder/run.json`` (its run id not in ``taken``); a damaged one moves the
    whole folder to ``damaged/`` and is None."""
    meta = folder / "run.json"
    try:
        if meta.is_symlink() or not meta.is_file():
            raise ValueError("not a regular file")
        data = parse_json(meta.read_bytes())
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not an object")
        for key, kinds in TYPES.items():
            if not kind_ok(data.get(key), kinds):
                raise ValueError(f"field {key!r} is missing or not {'/'.join(k.__name__ for k in kinds)}")
        if data["id"] != folder.name or data["tenant"] != folder.parent.name:
            raise ValueError("its id or tenant is not its folder's")
        if data["id"] in taken:
            raise ValueError(f"run id {data['id']!r} is another tenant's too")
        if data["rank"] < 1:
            raise ValueError(f"rank {data['rank']} is not positive")
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else str(exc)
        quarantine(root, folder, f"{meta} is damaged ({why})", "its run folder")
        return None
    return data


def read_lines(root: Path, path: Path, valid: Callable[[Any], bool]) -> list[dict[str, Any]]:
    """The records of a ``.jsonl`` that pass ``valid``; the lines that do not go to a file of the
    same name under ``damaged/`` and the file is rewritten with the rest."""
    if not path.exists() and not path.is_symlink():
        return []
    try:
        if path.is_symlink() or not path.is_file():
            raise OSError(0, "not a regular file")
        raw = path.read_bytes()
    except OSError as exc:
        quarantine(root, path, f"{path} is damaged ({exc.strerror})", "it")
        return []
    good, bad, records = [], [], []
    for line in raw.split(b"\n"):
        if not line.strip():
            continue
        try:
            record = parse_json(line)
        except ValueError:
            record = None
        if valid(record):
            good.append(line)
            records.append(record)
        else:
            bad.append(line)
    if bad:
        dest = damaged_path(root, path)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(dest, "xb") as f:
                f.write(b"\n".join(bad) + b"\n")
                f.flush()
                os.fsync(f.fileno())
            atomic_write_text(path, "".join(line.decode() + "\n" for line in good))
            fsync_dir(path.parent)
            where = f"moved to {dest}; its {len(good)} good lines are kept"
        except OSError as exc:
            where = f"skipped, the file is left as it is ({exc.strerror})"
        logger.warning(f"twinkle server: {path} has {len(bad)} damaged line(s); they are {where}")
    return records


def damaged_path(root: Path, path: Path) -> Path:
    """Where ``path`` (under ``root``) goes in ``damaged/``: the same relative path, with a
    number added when that name is taken."""
    damaged = root / DAMAGED
    if damaged.is_symlink():
        raise OSError(0, f"{damaged} is a symbolic link")
    dest = damaged / path.relative_to(root)
    n = 1
    while dest.exists() or dest.is_symlink():
        dest = dest.with_name(f"{path.name}.{n}")
        n += 1
    return dest


def quarantine(root: Path, path: Path, what: str, it: str) -> None:
    """Move ``path`` under ``damaged/`` with one warning (``what``, then where ``it`` went)."""
    try:
        dest = damaged_path(root, path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.rename(path, dest)
        fsync_dir(path.parent)
        where = f"{it} is moved to {dest}"
    except OSError as exc:
        where = f"{it} could not be moved to {root / DAMAGED} ({exc.strerror}) and is not served"
    logger.warning(f"twinkle server: {what}; {where}")
