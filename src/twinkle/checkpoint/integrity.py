"""What the completion marker proves: every file of the checkpoint still has the size and CRC-32
it had when the save finished.

The save writes ``.twinkle-complete`` last, as JSON listing every other file of the folder
(relative path -> size in bytes and CRC-32). A reader checks the folder against that list
before it reads any file, so a file truncated by an interrupted copy, a
flipped bit or a deleted file is one ``UserError`` naming the file, not an exception from deep
inside safetensors or ``torch.load``. CRC-32 is there to catch accidental damage: it reads about
twice as fast as blake2b, so checking a checkpoint costs little beside loading it.

The checksums detect damage, not tampering: anyone can recompute them, so a passing check says
nothing about who wrote a file. What keeps an untrusted checkpoint harmless is that nothing in it
is ever executed: every file is read as data (JSON, safetensors, ``torch.load(weights_only=True)``)
and a file that holds more than tensors and plain values is refused (``load.read_state``).

A marker holding just the word ``complete`` (the marker format without a list) still loads,
unverified, and that is logged once per folder."""

import json
import os
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from twinkle.utils.errors import UserError
from twinkle.utils.fileio import COMPLETE_MARKER
from twinkle.utils.logger import get_logger

CHUNK = 1 << 20  # read files in 1 MiB pieces: constant memory whatever their size
MANIFEST_FORMAT = 1
FIX = "resume from an earlier checkpoint or delete this one"

_unverified_logged: set[str] = set()


def crc32_of(path: str | os.PathLike) -> str:
    crc = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def manifest(folder: str | os.PathLike) -> dict[str, dict[str, int | str]]:
    """Every file under ``folder`` except the marker: relative POSIX path -> size and CRC-32."""
    folder = Path(folder)
    files: dict[str, dict[str, int | str]] = {}
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        for name in sorted(names):
            path = Path(root) / name
            rel = path.relative_to(folder).as_posix()
            if rel != COMPLETE_MARKER:
                files[rel] = {"size": path.stat().st_size, "crc32": crc32_of(path)}
    return files


def marker_text(folder: str | os.PathLike) -> str:
    """The completion marker of the finished ``folder`` (the save writes it last)."""
    body = {"complete": True, "format": MANIFEST_FORMAT, "checksum": "crc32", "files": manifest(folder)}
    return json.dumps(body, indent=1) + "\n"


@dataclass
class Report:
    """The result of checking a checkpoint folder against its marker."""

    problems: list[tuple[str, str]] = field(default_factory=list)  # (file, "is missing" / "is damaged (...)")
    verified: bool = True  # False: the marker lists no files, so nothing could be checked
    files: int = 0
    size: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def describe(self) -> str:
        """The problems as one line: ``adapter_model.safetensors is damaged (...), optimizer.pt is missing``."""
        return ", ".join(f"{name} {what}" for name, what in self.problems)


def _listed_files(folder: Path) -> dict | None:
    """The marker's file list; None when the marker has none (the plain ``complete`` marker).
    Raises ``ValueError`` when the marker is not one a save writes."""
    text = (folder / COMPLETE_MARKER).read_text(encoding="utf-8", errors="replace")
    if text.strip() == "complete":
        return None
    body = json.loads(text)
    files = body.get("files") if isinstance(body, dict) else None
    if not isinstance(files, dict) or not all(
        isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("crc32"), str)
        for v in files.values()
    ):
        raise ValueError("no file list")
    return files


def check(folder: str | os.PathLike, names: Iterable[str] | None = None) -> Report:
    """Check the files of ``folder`` that its marker lists (only those in ``names``, if given)
    against their recorded size and CRC-32. A folder without a marker (an interrupted save, or a
    PEFT adapter folder) has nothing to check against: ``verified`` is False, with no problem."""
    folder = Path(folder)
    if not (folder / COMPLETE_MARKER).is_file():
        return Report(verified=False)
    try:
        listed = _listed_files(folder)
    except (OSError, ValueError):
        return Report(problems=[(COMPLETE_MARKER, "is damaged (not the file list a save writes)")])
    if listed is None:
        return Report(verified=False)
    wanted = listed if names is None else {n: listed[n] for n in names if n in listed}
    report = Report(files=len(wanted))
    for rel, expected in wanted.items():
        path = folder / rel
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            report.problems.append((rel, "is missing"))
            continue
        report.size += size
        if size != expected["size"]:
            report.problems.append((rel, f"is damaged (size {size} of {expected['size']} bytes)"))
        elif crc32_of(path) != expected["crc32"]:
            report.problems.append(
                (rel, "is damaged (its contents changed since the save: checksum mismatch)")
            )
    return report


def log_unverified(folder: Path) -> None:
    key = str(folder.absolute())
    if key not in _unverified_logged:
        _unverified_logged.add(key)
        get_logger().warning(
            f"checkpoint {folder} was saved without checksums; its files are read unverified"
        )


def verify(folder: str | os.PathLike, names: Iterable[str] | None = None) -> None:
    """Raise a one-line ``UserError`` naming the first damaged file of ``folder`` (among
    ``names``, if given) and what to do; log once when the folder has no checksums."""
    folder = Path(folder)
    report = check(folder, names)
    if not report.verified and (folder / COMPLETE_MARKER).is_file():
        log_unverified(folder)
    if report.ok:
        return
    name, what = report.problems[0]
    more = len(report.problems) - 1
    also = f" ({more} more damaged file(s): `twinkle verify {folder}` lists them)" if more else ""
    raise UserError(f"{folder / name} {what}{also}: {FIX}")
