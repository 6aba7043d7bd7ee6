"""Read ``.jsonl`` / ``.json`` files into rows, naming the file and line of any bad record.

``datasets``' own JSON reader reports a malformed line as a deep pyarrow error; reading the
file ourselves first turns it into ``<file>:<line>: invalid JSON (<reason>)``."""

import json
from pathlib import Path
from typing import Any

from twinkle.utils.errors import UserError


def _check_object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise UserError(f"{where}: expected a JSON object per record, got {type(value).__name__}")
    return value


def _read_document(path: Path, text: str) -> list[dict[str, Any]]:
    """A ``.json`` file holding one array of objects."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})") from exc
    # Records may span several lines, so name the array index rather than a line.
    return [_check_object(value, f"{path}: record {index}") for index, value in enumerate(document)]


def _is_single_document(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def _read_lines(path: Path, text: str) -> list[dict[str, Any]]:
    """One JSON object per line (blank lines are skipped)."""
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            if not rows and _is_single_document(text):
                raise UserError(
                    f"{path}: holds one JSON object; write one object per line (JSON lines) "
                    "or a JSON array of objects"
                ) from exc
            raise UserError(f"{path}:{number}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
        rows.append(_check_object(value, f"{path}:{number}"))
    return rows


def read_json_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSON-lines file, or of a ``.json`` file that holds one array of objects."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    if text.lstrip().startswith("["):
        return _read_document(path, text)
    return _read_lines(path, text)
