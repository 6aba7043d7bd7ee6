"""``save_rows``: write rows to a JSONL, CSV or Parquet file, all at once or not at all."""

import contextlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

import datasets

from twinkle.utils.errors import UserError

# Suffix -> format. ``.json`` holds JSON lines, as upstream writes it.
SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}
FORMATS = ("jsonl", "json", "csv", "parquet")


def _plain(value: Any) -> Any:
    """numpy scalars and arrays (``datasets`` may hand them out) as JSON values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _format(path: Path, format: str | None) -> str:
    if format is not None:
        if format not in FORMATS:
            raise UserError(f"save_as: format {format!r} is not one of {', '.join(FORMATS)}")
        return "jsonl" if format == "json" else format
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise UserError(
            f"save_as: cannot tell the format of {str(path)!r} from its suffix; use one of "
            f"{', '.join(SUFFIXES)} or pass format="
        )
    return SUFFIXES[suffix]


def save_rows(data: datasets.Dataset, path: str | os.PathLike, format: str | None, batch_size: int) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename, so
    a reader never sees half a file and a failed write leaves any old file in place."""
    path = Path(path).expanduser()
    fmt = _format(path, format)
    if batch_size < 1:
        raise UserError(f"save_as: batch_size must be at least 1, got {batch_size}")
    path.parent.mkdir(parents=True, exist_ok=True)
    # A fresh name rather than ``mkstemp``, so the file gets the usual permissions (umask).
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        if fmt == "jsonl":
            with open(tmp, "w", encoding="utf-8") as handle:
                for batch in data.iter(batch_size=batch_size):
                    keys = list(batch)
                    for values in zip(*(batch[k] for k in keys), strict=True):
                        handle.write(
                            json.dumps(
                                dict(zip(keys, values, strict=True)), ensure_ascii=False, default=_plain
                            )
                        )
                        handle.write("\n")
        elif fmt == "csv":
            data.to_csv(tmp, batch_size=batch_size, index=False)
        else:
            data.to_parquet(tmp, batch_size=batch_size)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path
