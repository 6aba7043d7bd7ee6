"""``DatasetMeta``: what to load (a dataset id, or rows in memory), and ``load_rows`` to load it
with the origin of each row (``RowOrigin``)."""

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets

from twinkle.dataset.hashing import rows_hash, value_hash
from twinkle.dataset.origin import RowOrigin, report_skipped
from twinkle.hub.dataset import RowSource
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

logger = get_logger()


@dataclass
class DatasetMeta:
    """What to load: ``dataset_id`` or ``data``, exactly one.

    - ``dataset_id``: a local file or folder, or a hub id (``hf://``, ``ms://``); ``None`` is the
      bundled self-cognition rows. ``subset_name`` and ``split`` pick part of it (a local file or
      folder is read whole whatever ``subset_name`` says, unless a subfolder has that name).
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


MEMORY = "DatasetMeta(data=...)"


def rows_from_memory(data: Any, skip_bad_rows: bool = False) -> tuple[datasets.Dataset, RowOrigin, list[str]]:
    """Rows given as ``DatasetMeta(data=...)`` as a ``datasets.Dataset``, their origin, and the
    rows ``skip_bad_rows`` left out because a value's type differs from the other rows'."""
    if isinstance(data, datasets.Dataset):
        rows, kept, skipped = data, None, []
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
        rows, kept, skipped = _from_rows(data, skip_bad_rows)
    elif isinstance(data, dict):
        lengths = {len(v) if isinstance(v, list) else -1 for v in data.values()}
        if -1 in lengths or len(lengths) > 1:
            raise UserError("DatasetMeta(data={...}) must map each column name to a list, all of one length")
        try:
            rows, kept, skipped = datasets.Dataset.from_dict(data), None, []
        except Exception:  # name the row and field that mix types
            rows, kept, skipped = _from_rows(
                [dict(zip(data, v, strict=True)) for v in zip(*data.values(), strict=True)], skip_bad_rows
            )
    else:
        raise UserError(
            f"DatasetMeta(data=...) must be a list of dicts, a dict of lists or a datasets.Dataset, got {type(data).__name__}"
        )
    if len(rows) == 0 and not skipped:
        raise UserError("DatasetMeta(data=...) holds no rows; pass at least one")
    numbers = None if kept is None or not skipped else tuple(kept)
    return rows, RowOrigin.of_sources([RowSource(MEMORY, len(rows), None, numbers)]), skipped


def _from_rows(
    data: list[dict[str, Any]], skip_bad_rows: bool
) -> tuple[datasets.Dataset, list[int], list[str]]:
    from twinkle.hub.dataset import rows_with_conflicts

    return rows_with_conflicts(data, MEMORY, lambda i: f"{MEMORY}: row {i}", skip_bad_rows)


def local_subset(meta: DatasetMeta) -> str | None:
    """The subset to read: a local file or folder is read whole, as upstream reads it, unless
    the folder holds a subfolder named ``subset_name`` (then that subfolder). A script written
    for a hub id with a subset (``subset_name='main'``) so runs on a local copy unchanged."""
    name, path = meta.subset_name, Path(meta.dataset_id or "").expanduser()
    if not name or not meta.dataset_id or not path.exists() or (path.is_dir() and (path / name).is_dir()):
        return name
    logger.info(
        f"dataset {meta.dataset_id!r} is a local {'folder' if path.is_dir() else 'file'}: read whole, subset_name={name!r} does not apply"
    )
    return None


def load_rows(meta: DatasetMeta, skip_bad_rows: bool = False) -> tuple[datasets.Dataset, RowOrigin]:
    """The rows ``meta`` names, narrowed to its ``data_slice``, and where each one came from.
    A row whose value has another type than the other rows' in that field is an error naming
    it; with ``skip_bad_rows`` it is left out, and the rows left out are logged in one line."""
    from twinkle.hub.dataset import resolve_dataset_sources

    if meta.data is not None:
        data, origin, skipped = rows_from_memory(meta.data, skip_bad_rows)
        read = len(data) + len(skipped)
    else:
        data, sources, skipped, read = resolve_dataset_sources(
            meta.dataset_id, subset_name=local_subset(meta), split=meta.split, skip_bad_rows=skip_bad_rows
        )
        origin = RowOrigin.of_sources(sources)
    report_skipped(skipped, len(skipped), read, "load")
    if meta.data_slice is None:
        return data, origin
    indices = [int(i) % len(data) for i in meta.data_slice]
    if not indices:
        name = "data=..." if meta.data is not None else meta.dataset_id or "self-cognition"
        raise UserError(
            f"data_slice selects no rows of dataset {name}; ask for at least one sample (e.g. --train-samples 1)"
        )
    if len(indices) > len(data):
        logger.info(f"data_slice asks for {len(indices)} samples of a {len(data)}-row dataset: rows repeat")
    return data.select(indices), origin.take(indices)


def schema_of(features: Any) -> datasets.Features | None:
    """``Dataset(features=...)`` (upstream's name) as ``datasets.Features``, or None."""
    if features is None or isinstance(features, datasets.Features):
        return features
    if not isinstance(features, dict):
        raise UserError(f"Dataset(features=...) takes datasets.Features, got {type(features).__name__}")
    for name, feature in features.items():
        if isinstance(feature, str):
            raise UserError(
                f"Dataset(features=...): {name!r} is the text {feature!r}; give a datasets feature, "
                "e.g. datasets.Image() or datasets.Value('string')"
            )
    return datasets.Features(features)


def with_schema(rows: datasets.Dataset, schema: datasets.Features, name: str) -> datasets.Dataset:
    """The loaded ``rows`` with the columns ``schema`` names cast to its types (a column of image
    paths or bytes to ``datasets.Image()``: rows then give PIL images, as upstream's do). The
    columns it names that loading does not give (upstream's ``messages``) are what ``map``
    writes; ``map`` stores the images of ``messages`` itself (``twinkle.dataset.image_rows``)."""
    loaded = {key: feature for key, feature in schema.items() if key in rows.column_names}
    later = [key for key in schema if key not in rows.column_names]
    if later:
        logger.info(
            f"Dataset(features=...): {', '.join(later)} are not columns of {name}; map writes them "
            "(the images of messages as paths or data URIs)"
        )
    if not loaded or all(rows.features[key] == feature for key, feature in loaded.items()):
        return rows
    try:
        return rows.cast(datasets.Features({**rows.features, **loaded}))
    except Exception as exc:  # datasets raises ValueError, TypeError or pyarrow's errors
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"Dataset(features=...): cannot cast the column(s) {', '.join(loaded)} of {name}: {reason}; "
            "give the types the columns hold, or leave features out"
        ) from None
