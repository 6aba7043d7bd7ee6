"""Content hashes: equal content gives the same hex string in every process and on every run."""

import json
from typing import Any

import datasets
import pyarrow as pa
import xxhash  # a dependency of ``datasets``

_BATCH_ROWS = 10_000


def value_hash(value: Any) -> str:
    """Hash of a JSON-like value (dict keys in any order hash alike)."""
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, default=repr)
    return xxhash.xxh3_128_hexdigest(text.encode("utf-8"))


def rows_hash(data: datasets.Dataset) -> str:
    """Hash of the rows of ``data`` in order, and of their column types.

    Rows are read through any index mapping (``select``, ``shuffle``) and re-laid out with a
    ``take`` before serialising, so a slice of a bigger table hashes like the same rows stored
    on their own."""
    hasher = xxhash.xxh3_128()
    hasher.update(repr(data.features).encode("utf-8"))
    hasher.update(str(len(data)).encode())
    for table in data.with_format("arrow").iter(batch_size=_BATCH_ROWS):
        compact = table.take(pa.array(range(table.num_rows), type=pa.int64()))
        for batch in compact.to_batches():
            hasher.update(batch.serialize())
    return hasher.hexdigest()
