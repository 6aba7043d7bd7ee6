"""Read ``.jsonl`` / ``.json`` files into rows, naming the file and line of any bad record.

``datasets``' own JSON reader reports a malformed line as a deep pyarrow error; reading the
file ourselves first turns it into ``<file>:<line>: invalid JSON (<reason>)``. The line of each
row is kept (``read_json_records``) so that a row found bad later is named by its line too."""

import json
from collections import Counter
from pathlib import Path
from typing import Any

from twinkle.utils.errors import UserError
from twinkle.utils.values import kind_of

# How to go on past bad rows, quoted in every bad-row error.
SKIP_HINT = "or pass --skip-bad-rows (Dataset(skip_bad_rows=True)) to drop such rows"


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


def _read_lines(path: Path, text: str) -> tuple[list[dict[str, Any]], list[int]]:
    """One JSON object per line (blank lines are skipped), and each one's line number."""
    rows, lines = [], []
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
        lines.append(number)
    return rows, lines


def read_json_records(path: Path) -> tuple[list[dict[str, Any]], list[int] | None]:
    """Rows of a JSON-lines file, or of a ``.json`` file that holds one array of objects; and
    the line of each row (None for an array, whose records may span several lines)."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    if text.lstrip().startswith("["):
        return _read_document(path, text), None
    return _read_lines(path, text)


def read_json_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSON-lines file, or of a ``.json`` file that holds one array of objects."""
    return read_json_records(path)[0]


def _kind(value: Any) -> str | None:
    """The Arrow-relevant kind of a row's value; None (null) fits any column. Rows given in
    Python (``DatasetMeta(data=...)``) may hold values JSON cannot (bytes, tuples, images): bytes
    are a kind of their own, a tuple is a list (as Arrow stores it), and any other value is
    its type's name, looked at whole rather than walked into."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "text"
    if isinstance(value, bytes | bytearray | memoryview):
        return "bytes"
    if isinstance(value, list | tuple):
        return "list"
    return "object" if isinstance(value, dict) else type(value).__name__


def _described(value: Any) -> str:
    """``kind_of``'s words for a value, with bytes said as such."""
    return "bytes" if _kind(value) == "bytes" else kind_of(value)


def _expected(kind: str) -> str:
    """What most rows hold, as the conflict message says it."""
    return {"text": "text", "bytes": "bytes", "object": "an object"}.get(kind, f"a {kind}")


def _walk(value: Any, generic: str, exact: str, out: list[tuple[str, str, str, Any]]) -> None:
    """(place shared by all rows, place in this row, kind, value) of ``value`` and what it holds."""
    kind = _kind(value)
    if kind is None:
        return
    out.append((generic, exact, kind, value))
    if kind == "list":
        for i, item in enumerate(value):
            _walk(item, f"{generic}[]", f"{exact}[{i}]", out)
    elif kind == "object":
        for key, item in value.items():
            _walk(item, f"{generic}.{key}", f"{exact}.{key}", out)


def type_conflicts(rows: list[dict[str, Any]]) -> list[tuple[int, str, str]]:
    """Rows holding a value of another kind than most rows hold in the same place (a number
    in a text column, text where others have a list...), which one Arrow column cannot store:
    ``(row index, field, what is wrong)``, the first such value of each row."""
    walked = []
    counts: dict[str, Counter] = {}
    for row in rows:
        found: list[tuple[str, str, str, Any]] = []
        for key, value in row.items():
            _walk(value, key, key, found)
        walked.append(found)
        for generic, kind in {(g, k) for g, _, k, _ in found}:
            counts.setdefault(generic, Counter())[kind] += 1
    usual = {generic: kinds.most_common(1)[0][0] for generic, kinds in counts.items()}
    conflicts = []
    for index, found in enumerate(walked):
        for generic, exact, kind, value in found:
            if kind != usual[generic]:
                expected = _expected(usual[generic])
                conflicts.append(
                    (index, exact, f"{exact!r} is {_described(value)} where most rows hold {expected}")
                )
                break
    return conflicts
