"""``DatasetMeta``: what to load (a dataset id, or rows in memory), and ``load_rows`` to load it."""

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import datasets

from twinkle.dataset.hashing import rows_hash, value_hash
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

logger = get_logger()


@dataclass
class DatasetMeta:
    """What to load: ``dataset_id`` or ``data``, exactly one.

    - ``dataset_id``: a local file or folder, or a hub id (``hf://``, ``ms://``); ``None`` is the
      bundled self-cognition rows. ``subset_name`` and ``split`` pick part of it.
    - ``data``: rows already in memory: a list of dicts, a dict of equal-length column lists, or
      a ``datasets.Dataset``.
    - ``data_slice`` picks rows by index; indices past the end wrap around, so ``range(1000)``
      over a 150-row set repeats it in order."""

    dataset_id: str | None = ""
    subset_name: str | None = None
    split: str = "train"
    data_slice: Iterable[int] | None = None
    data: Any = None

    def __post_init__(self) -> None:
        if self.data is not None and self.dataset_id not in ("", None):
            raise UserError("DatasetMeta: pass dataset_id or data, not both")
        if self.data is None and self.dataset_id == "":
            raise UserError(
                "DatasetMeta needs dataset_id (a file, folder or hub id; None for the bundled rows) or data=<rows>"
            )
        if self.data is not None and (self.subset_name is not None or self.split != "train"):
            raise UserError(
                "DatasetMeta: subset_name and split pick part of a dataset_id; with data=, pass only the rows you want"
            )
        if self.data_slice is not None and not isinstance(self.data_slice, Iterable):
            raise UserError(
                f"DatasetMeta: data_slice must be an iterable of row indices (e.g. range(100)), got {self.data_slice!r}"
            )

    def get_id(self) -> str:
        """A stable name, ``<source>:<subset>:<split>``: the path or hub id with separators and dots
        turned into ``_``, or ``__memory_<content hash>__`` for rows in memory (equal rows, equal id)."""
        subset = self.subset_name or "default"
        if self.data is not None:
            source = f"__memory_{_memory_hash(self.data)[:16]}__"
        elif self.dataset_id is None:
            source = "self-cognition"
        else:
            source = self.dataset_id.replace(os.sep, "_").replace(".", "_")
        return f"{source}:{subset}:{self.split}"


def _memory_hash(data: Any) -> str:
    return rows_hash(data) if isinstance(data, datasets.Dataset) else value_hash(data)


def rows_from_memory(data: Any) -> datasets.Dataset:
    """Rows given as ``DatasetMeta(data=...)`` as a ``datasets.Dataset``."""
    if isinstance(data, datasets.Dataset):
        rows = data
    elif isinstance(data, datasets.DatasetDict):
        raise UserError(
            f"DatasetMeta(data=...) got a DatasetDict; pass one split, e.g. data=d['train'] (splits: {list(data)})"
        )
    elif isinstance(data, datasets.IterableDataset) or callable(data):
        raise UserError(
            "DatasetMeta(data=...) is not supported yet: streamed rows (a generator or IterableDataset); "
            "pass a list of dicts or a datasets.Dataset"
        )
    elif isinstance(data, list):
        if not all(isinstance(row, dict) for row in data):
            raise UserError("DatasetMeta(data=[...]) must be a list of dicts, one per row")
        # Every key of every row, in first-seen order (``from_list`` keeps only the first row's).
        columns = list(dict.fromkeys(key for row in data for key in row))
        rows = _from_columns({key: [row.get(key) for row in data] for key in columns})
    elif isinstance(data, dict):
        lengths = {len(v) if isinstance(v, list) else -1 for v in data.values()}
        if -1 in lengths or len(lengths) > 1:
            raise UserError("DatasetMeta(data={...}) must map each column name to a list, all of one length")
        rows = _from_columns(data)
    else:
        raise UserError(
            f"DatasetMeta(data=...) must be a list of dicts, a dict of lists or a datasets.Dataset, got {type(data).__name__}"
        )
    if len(rows) == 0:
        raise UserError("DatasetMeta(data=...) holds no rows; pass at least one")
    return rows


def _from_columns(columns: dict[str, list]) -> datasets.Dataset:
    try:
        return datasets.Dataset.from_dict(columns)
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"DatasetMeta(data=...): a column mixes value types ({reason}); make rows consistent"
        ) from exc


def load_rows(meta: DatasetMeta) -> datasets.Dataset:
    """The rows ``meta`` names, narrowed to its ``data_slice``."""
    from twinkle.hub import resolve_dataset

    if meta.data is not None:
        data = rows_from_memory(meta.data)
    else:
        data = resolve_dataset(meta.dataset_id, subset_name=meta.subset_name, split=meta.split)
    if meta.data_slice is None:
        return data
    indices = [int(i) % len(data) for i in meta.data_slice]
    if not indices:
        name = "data=..." if meta.data is not None else meta.dataset_id or "self-cognition"
        raise UserError(
            f"data_slice selects no rows of dataset {name}; ask for at least one sample (e.g. --train-samples 1)"
        )
    if len(indices) > len(data):
        logger.info(f"data_slice asks for {len(indices)} samples of a {len(data)}-row dataset: rows repeat")
    return data.select(indices)
