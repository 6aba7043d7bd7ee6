"""``IterableDataset``: a dataset read as a stream, for data larger than memory.

The chain is ``Dataset``'s (``map(preprocessor)``, ``set_template``, ``encode``) but nothing
runs ahead: each row is preprocessed and encoded when it is read. There is no ``len`` and no
indexing. The files are read with Hugging Face ``datasets`` in streaming mode (local files
only; a hub id is fetched to its local snapshot first); ``DatasetMeta(data=...)`` streams
rows given in memory, a ``datasets.IterableDataset`` among them.

``raw_rows()`` and ``finish_row(row, index)`` split reading from the per-row work so that
``twinkle.dataloader.DataLoader`` reads the stream in one process and preprocesses and encodes
in its workers; iterating the dataset does both in turn."""

from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch.utils.data

from twinkle.dataset.dataset import DatasetMeta
from twinkle.dataset.meta import local_subset
from twinkle.dataset.ops import resolve_function, row_function
from twinkle.dataset.pairs import drop_reason, encode_pair
from twinkle.hub.dataset import (
    BUNDLED_DATASET_NAMES,
    BUNDLED_PREFERENCE_NAMES,
    FORMATS,
    _data_files,
    bundled_dataset_path,
    bundled_preference_path,
)
from twinkle.hub.remote import looks_like_hub_id, snapshot
from twinkle.preprocessor.base import BadRow
from twinkle.template import Template, get_template
from twinkle.template.base import IGNORE_INDEX
from twinkle.template.tokenizer import load_tokenizer
from twinkle.utils.cache import cache_root
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

logger = get_logger()


def _reason(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:160] if text else type(exc).__name__


def _files(meta: DatasetMeta) -> tuple[list[Path], str]:
    """The data files of ``meta`` and the dataset's name for messages."""
    dataset_id = meta.dataset_id
    if dataset_id is None or dataset_id in BUNDLED_DATASET_NAMES:
        return [bundled_dataset_path()], "self-cognition"
    if dataset_id in BUNDLED_PREFERENCE_NAMES:
        return [bundled_preference_path(meta.split)], "self-cognition-dpo"
    path = Path(dataset_id).expanduser()
    if path.is_dir():
        return _data_files(path, dataset_id, local_subset(meta), meta.split), dataset_id
    if path.exists():
        if path.suffix.lower() not in FORMATS:
            raise UserError(
                f"dataset file {dataset_id!r} has an unsupported extension; supported: {', '.join(FORMATS)}"
            )
        if meta.split != "train":
            raise UserError(f"dataset file {dataset_id!r} has only a 'train' split; use split='train'")
        return [path], dataset_id
    if looks_like_hub_id(dataset_id):
        return _data_files(
            snapshot(dataset_id, "dataset"), dataset_id, meta.subset_name, meta.split
        ), dataset_id
    raise UserError(
        f"dataset path {dataset_id!r} does not exist; pass an existing file or folder, or hf://org/name"
    )


def _rows_in_memory(data: Any) -> Any:
    """``DatasetMeta(data=...)`` as something to iterate: a ``datasets`` stream as it is."""
    import datasets

    if isinstance(data, datasets.IterableDataset):
        return data
    if isinstance(data, datasets.Dataset):
        return data.to_iterable_dataset()
    if isinstance(data, dict):  # columns of equal length
        return [dict(zip(data, values, strict=True)) for values in zip(*data.values(), strict=True)]
    return list(data)


def open_stream(meta: DatasetMeta) -> tuple[Any, str]:
    """``meta``'s rows as a streaming ``datasets.IterableDataset`` (rows given in memory as
    they are), and the dataset's name for messages."""
    import datasets

    if getattr(meta, "data", None) is not None:
        return _rows_in_memory(meta.data), "rows in memory"
    files, name = _files(meta)
    builders = {FORMATS[path.suffix.lower()] for path in files}
    if len(builders) > 1:
        raise UserError(
            f"dataset {name!r} mixes file formats ({', '.join(sorted(builders))}); keep one format"
        )
    root = cache_root() / "datasets"
    try:
        stream = datasets.load_dataset(
            builders.pop(),
            data_files=[str(path) for path in files],
            split="train",
            streaming=True,
            cache_dir=str(root),
            download_config=datasets.DownloadConfig(local_files_only=True, cache_dir=str(root / "downloads")),
        )
    except Exception as exc:
        raise UserError(f"could not open dataset {name!r} as a stream ({_reason(exc)})") from exc
    return stream, name


def _picks(data_slice: Iterable[int] | None, name: str) -> Sequence[int] | None:
    """The rows ``data_slice`` picks, checked: a stream is read once, in order, so they must
    increase (a ``range`` stays a range, anything else becomes a list)."""
    if data_slice is None:
        return None
    if isinstance(data_slice, range):
        picks: Sequence[int] = data_slice
        ok = data_slice.step > 0 and data_slice.start >= 0
    else:
        picks = [int(i) for i in data_slice]
        ok = all(a < b for a, b in zip(picks, picks[1:], strict=False)) and (not picks or picks[0] >= 0)
    if len(picks) == 0:
        raise UserError(f"data_slice selects no rows of dataset {name}; ask for at least one sample")
    if not ok:
        raise UserError(
            f"data_slice of the stream {name!r} must pick rows in increasing order without repeats "
            "(e.g. range(100)); load it with Dataset to repeat or reorder rows"
        )
    return picks


class IterableDataset(torch.utils.data.IterableDataset):
    """A stream of rows that becomes a stream of encoded samples. Methods return ``self``.

    ``next(dataset)`` reads the next sample of one running pass; ``iter(dataset)`` starts a
    pass. A sample that encoding drops (``truncation_strategy='delete'``, or no supervised
    token left) is skipped. It is a torch ``IterableDataset`` too."""

    def __init__(self, dataset_meta: DatasetMeta):
        self.meta = dataset_meta
        self.data, self.name = open_stream(dataset_meta)
        self.picks = _picks(dataset_meta.data_slice, self.name)
        self.template: Template | None = None
        self.preprocessors: list[Callable[[dict[str, Any], int | None], Any]] = []
        self.encoded = False
        self._iterator: Iterator[dict[str, Any]] | None = None
        self._warned_drop = False

    def set_template(
        self,
        template_cls: str | type[Template] = "Template",
        model_id: str | None = None,
        max_length: int = 1024,
        truncation_strategy: str = "right",
    ) -> "IterableDataset":
        """Choose how rows become tokens (the tokenizer comes from ``model_id``)."""
        tokenizer = load_tokenizer(model_id)
        self.template = get_template(
            template_cls, tokenizer, max_length=max_length, truncation_strategy=truncation_strategy
        )
        return self

    def map(
        self, preprocess_func: Callable[..., Any] | str | type, init_args: dict[str, Any] | None = None
    ) -> "IterableDataset":
        """Apply a preprocessor (instance, class built with ``init_args``, or name) or a row
        function to each row as it is read (``twinkle.dataset.ops.row_function``)."""
        self.preprocessors.append(row_function(resolve_function(preprocess_func, init_args, "map")))
        return self

    def encode(self) -> "IterableDataset":
        """Tokenise each conversation as it is read (``input_ids``, ``labels``, ...)."""
        if self.template is None:
            raise UserError("call dataset.set_template(...) before dataset.encode()")
        self.encoded = True
        return self

    @property
    def pad_token_id(self) -> int:
        if self.template is None:
            raise UserError("call dataset.set_template(...) first")
        return self.template.pad_token_id

    def _read(self) -> Iterator[dict[str, Any]]:
        rows = iter(self.data)
        while True:
            try:
                row = next(rows)
            except StopIteration:
                return
            except Exception as exc:
                raise UserError(f"could not read dataset {self.name!r} ({_reason(exc)})") from exc
            yield row

    def raw_rows(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(index, row)`` of the rows ``data_slice`` picks, unprocessed; ``index`` counts the
        picked rows (as ``Dataset`` numbers the rows of its slice)."""
        if self.picks is None:
            yield from enumerate(self._read())
            return
        picks = iter(self.picks)
        target = next(picks, None)
        position = 0
        for i, row in enumerate(self._read()):
            if target is None:
                return
            if i == target:
                yield position, row
                position += 1
                target = next(picks, None)

    def finish_row(self, row: dict[str, Any], index: int) -> dict[str, Any] | None:
        """Preprocess and (after ``encode()``) encode one row; ``None`` when encoding drops it."""
        try:
            for preprocessor in self.preprocessors:
                row = preprocessor(row, index)
                if row is None:  # the preprocessor dropped it
                    return None
        except BadRow as exc:  # a stream knows its dataset's name and the row's number in it
            raise UserError(f"{exc.at(f'dataset {self.name}: row {index}')}; fix the row") from exc
        if not self.encoded:
            return row
        if "positive" in row and "negative" in row:
            return self._finish_pair(row, index)
        if "messages" not in row:
            raise UserError("rows have no 'messages'; call dataset.map(<preprocessor>) before encode()")
        out = self.template.encode(row["messages"], index=index)
        if out is None or not any(t != IGNORE_INDEX for t in out["labels"]):
            if not self._warned_drop:
                self._warned_drop = True
                logger.warning(
                    f"samples are dropped (the first at row {index}): no supervised token left after "
                    f"--max-length {self.template.max_length} with --truncation-strategy "
                    f"{self.template.truncation_strategy}"
                )
            return None
        return out

    def _finish_pair(self, row: dict[str, Any], index: int) -> dict[str, Any] | None:
        """A preference pair encoded (``twinkle.dataset.pairs``); None when truncation drops it."""
        try:
            out = encode_pair(self.template, row, index)
        except BadRow as exc:
            raise UserError(f"{exc.at(f'dataset {self.name}: row {index}')}; fix the row") from exc
        if out is None and not self._warned_drop:
            self._warned_drop = True
            logger.warning(f"pairs are dropped (the first at row {index}): {drop_reason(self.template)}")
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for index, row in self.raw_rows():
            out = self.finish_row(row, index)
            if out is not None:
                yield out

    def __next__(self) -> dict[str, Any]:
        if self._iterator is None:
            self._iterator = iter(self)
        return next(self._iterator)
