"""``LazyDataset``: a ``Dataset`` whose ``map`` and ``encode`` run on a row when it is read.

Loading, ``filter`` and ``mix_dataset`` run at once on the raw rows, as in ``Dataset``; ``map``
and ``encode`` are recorded and applied in ``__getitem__``, so a large dataset is never held
preprocessed and encoded in memory (nor written to the encode cache). ``mix_dataset`` after
``map`` (upstream's order: each subset mapped with its own preprocessor, then mixed) mixes
(dataset, row) tags, and a read takes that dataset's raw row and applies its maps. A ``DataLoader`` with
``num_workers`` then preprocesses and encodes in its workers.

A row that encoding drops (truncation) reads as None, which the ``DataLoader`` leaves out of its
batch; a bad row (``BadRow``) is an error naming its file and line, or, with ``skip_bad_rows``,
reads as None too and is counted in ``skipped_rows``."""

from collections.abc import Callable
from typing import Any

import datasets

from twinkle.dataset import pairs as pairs_module
from twinkle.dataset.dataset import Dataset, DatasetMeta
from twinkle.dataset.encode import _encode_one
from twinkle.dataset.ops import reject_unsupported, resolve_function, row_function
from twinkle.dataset.origin import located
from twinkle.dataset.prompts import encode_prompt
from twinkle.preprocessor.base import BadRow
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

logger = get_logger()
RowFunction = Callable[[dict[str, Any], int | None], Any]
SOURCE = ("_twinkle_source", "_twinkle_source_row")  # a mix after map() mixes these (dataset, row) tags


class LazyDataset(Dataset):
    """Upstream's ``LazyDataset(dataset_meta)``: ``Dataset``'s chain, preprocessing and encoding
    deferred to each read (see the module docstring)."""

    def __init__(self, dataset_meta: DatasetMeta | None = None, skip_bad_rows: bool | None = None):
        self._ops: list[list[RowFunction]] = []  # per added dataset, in order
        self._encode: str | None = None  # None, "samples" or "prompts"
        # mix_dataset after map: each source dataset's (maps, origin, rows), read through SOURCE
        self._sources: tuple[list[list[RowFunction]], list[Any], list[Any]] | None = None
        self.skipped_rows = 0
        super().__init__(dataset_meta, skip_bad_rows)

    def add_dataset(self, dataset_meta: "DatasetMeta | Dataset") -> "LazyDataset":
        before = len(self._parts)
        super().add_dataset(dataset_meta)
        self._ops += [[] for _ in range(len(self._parts) - before)]
        return self

    def map(
        self,
        preprocess_func: Callable[..., Any] | str | type,
        dataset_meta: DatasetMeta | None = None,
        init_args: dict[str, Any] | None = None,
        **unsupported: Any,
    ) -> "LazyDataset":
        """Record ``preprocess_func`` (as ``Dataset.map`` takes it) to run on each row when read,
        for ``dataset_meta``'s rows or every added dataset's. A batched upstream-shaped
        ``Preprocessor`` gets the row alone, as columns of one row."""
        reject_unsupported("map", unsupported)
        if self._encode is not None:
            raise UserError("LazyDataset.map after encode(); call map() before encode()")
        fn = row_function(resolve_function(preprocess_func, init_args, "map"))
        for i in self._selected(dataset_meta, "map"):
            self._ops[i].append(fn)
        return self

    def _refuse_after_map(self, method: str) -> None:
        if any(self._ops) or self._encode is not None:
            raise UserError(
                f"LazyDataset.{method} runs on the raw rows at once, but map()/encode() wait for each "
                f"read; call {method}() before map()"
            )

    def filter(
        self, filter_func: Any, dataset_meta: DatasetMeta | None = None, **kwargs: Any
    ) -> "LazyDataset":
        self._refuse_after_map("filter")
        super().filter(filter_func, dataset_meta, **kwargs)
        return self

    def mix_dataset(self, *args: Any, **kwargs: Any) -> "LazyDataset":
        if self._encode is not None:
            raise UserError("LazyDataset.mix_dataset after encode(); call mix_dataset() before encode()")
        if not any(self._ops) or len(self._parts) < 2:
            super().mix_dataset(*args, **kwargs)
            self._ops = [self._ops[0]] if len(self._parts) == 1 and self._ops else [[] for _ in self._parts]
            return self
        if self._sources is not None:
            raise UserError("LazyDataset.mix_dataset a second time after map(); mix all the datasets at once")
        # the raw columns may differ until each dataset's maps run: mix (dataset, row) tags
        sources = (self._ops, self._origins, [rows for _, rows in self._parts])
        self._parts = [
            (key, datasets.Dataset.from_dict({SOURCE[0]: [i] * len(rows), SOURCE[1]: list(range(len(rows)))}))
            for i, (key, rows) in enumerate(self._parts)
        ]
        super().mix_dataset(*args, **kwargs)
        self._sources, self._ops = sources, [[] for _ in self._parts]
        return self

    def encode(
        self,
        add_generation_prompt: bool = False,
        batched: bool = True,
        batch_size: int = 1000,
        num_proc: int | None = None,
        load_from_cache_file: bool = False,
        **unsupported: Any,
    ) -> "LazyDataset":
        """Encode each row when it is read (``Dataset.encode``'s samples, pairs or, with
        ``add_generation_prompt``, prompts). ``batched``, ``batch_size``, ``num_proc`` and
        ``load_from_cache_file`` set how a whole dataset is encoded at once; a lazy one encodes a
        row at a time and caches nothing, which is logged when they are given."""
        reject_unsupported("encode", unsupported)
        if self.template is None:
            raise UserError("call dataset.set_template(...) before dataset.encode()")
        if add_generation_prompt and getattr(self.template, "encodes_images", False):
            raise UserError(
                f"LazyDataset.encode: prompt rows (add_generation_prompt=True) are not supported yet for "
                f"{type(self.template).__name__}; encode conversations with replies"
            )
        given = [
            name
            for name, value, default in (
                ("batch_size", batch_size, 1000),
                ("num_proc", num_proc, None),
                ("load_from_cache_file", load_from_cache_file, False),
            )
            if value != default
        ]
        if given:
            logger.info(f"LazyDataset.encode: {', '.join(given)} do not apply: each row is encoded when read")
        self._encode = "prompts" if add_generation_prompt else "samples"
        return self

    def _part_of(self, index: int) -> tuple[int, int]:
        """``(added dataset, its row)`` of row ``index`` of the concatenated rows."""
        if not 0 <= index < len(self):
            raise IndexError(f"LazyDataset index {index} out of range ({len(self)} rows)")
        for part, (_, rows) in enumerate(self._parts):
            if index < len(rows):
                return part, index
            index -= len(rows)
        raise AssertionError("unreachable: the index was checked against the length")

    def __getitem__(self, index: int) -> dict[str, Any] | None:
        part, local = self._part_of(int(index))
        row = dict(self._parts[part][1][local])
        ops, origin = self._ops[part], self._origins[part]
        if self._sources is not None and SOURCE[0] in row:  # mixed after map: its dataset's row and maps
            source, local = row[SOURCE[0]], row[SOURCE[1]]
            row = dict(self._sources[2][source][local])
            ops, origin = self._sources[0][source] + ops, self._sources[1][source]
        try:
            for fn in ops:
                row = fn(row, local)
                if row is None:
                    return None
            return self._encoded(row, local)
        except BadRow as exc:
            if not self.skip_bad_rows:
                raise located(exc, origin) from exc
            self.skipped_rows += 1
            logger.warning(f"--skip-bad-rows: {exc.at(origin.where(local))}")
            return None

    def _encoded(self, row: dict[str, Any], index: int) -> dict[str, Any] | None:
        if self._encode is None:
            return row
        if getattr(self.template, "encodes_images", False) and all(
            side in row for side in pairs_module.SIDES
        ):
            raise UserError(
                f"{type(self.template).__name__}: preference pairs are not supported yet for images; "
                "encode conversations (messages with replies)"
            )
        if self._encode == "prompts":
            prompt = encode_prompt(self.template, row.get("messages"), index)
            return None if prompt is None else {**row, **prompt}
        if all(side in row for side in pairs_module.SIDES):
            return pairs_module.encode_pair(self.template, row, index)
        return _encode_one(self.template, row.get("messages"), index)
