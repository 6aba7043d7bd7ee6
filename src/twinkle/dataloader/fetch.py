"""Carry out a planned step: read this rank's rows, retrying a row whose read raises, and
collate them.

``Fetcher`` runs in the loader's own process or, with ``num_workers > 0``, inside torch's
worker processes, which call it as a map-style dataset indexed by the step (``fetcher[step]``).
Either way a step gives the same batch, so the worker count changes speed only.

A dataset that counts the bad rows it leaves out (``LazyDataset.skipped_rows`` under
``skip_bad_rows``) counts them in the process that reads them: in a worker, on the worker's copy.
So each step also returns how many rows the dataset skipped while reading it, and the loader adds
that to its own process's dataset (``DataLoader.__iter__``), whose count is then the same whatever
the worker count."""

from collections.abc import Callable
from typing import Any

from twinkle.dataloader.steps import Step
from twinkle.utils.errors import UserError

# (batch, samples the step consumed, one line per failed read, rows the dataset skipped reading it)
Fetched = tuple[Any, int, list[str], int]


def rows_as_is(rows: list[Any]) -> list[Any]:
    """The collate function of rows that are not encoded: the list of this rank's rows."""
    return list(rows)


def as_is(fetched: Fetched) -> Fetched:
    """torch's collate function here: the fetcher has collated the batch already."""
    return fetched


class Fetcher:
    """Read the rows of a step and collate them.

    A map-style dataset is read as ``dataset[index]``. A stream's rows arrive with the step
    (read in the loader's process, in order) and are finished here: ``dataset.finish_row(row,
    index)`` (preprocess and encode, see ``twinkle.dataset.iterable``) where the dataset has it,
    so that the expensive part of a stream runs in the workers. A read that raises is tried
    again up to ``max_retries`` times, then the row is left out of the batch and reported; a
    ``UserError`` is the data's own fault, the same at every try, and stops the pass. A row
    read as ``None`` (dropped by encoding) is left out silently."""

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any], max_retries: int, stream: bool):
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.max_retries = max_retries
        self.stream = stream
        self.finish_row = getattr(dataset, "finish_row", None) if stream else None

    def __call__(self, step: Step) -> Fetched:
        rows, failed = [], []
        before = self.skipped_rows()
        for item in step.share:
            row, error = self._read(item)
            if error is not None:
                failed.append(error)
            elif row is not None:
                rows.append(row)
        return self.collate_fn(rows), step.size, failed, self.skipped_rows() - before

    def skipped_rows(self) -> int:
        """The dataset's count of the bad rows it left out (0 for a dataset that keeps none)."""
        count = getattr(self.dataset, "skipped_rows", 0)
        return count if isinstance(count, int) else 0

    __getitem__ = __call__

    def _read_once(self, item: Any) -> Any:
        if not self.stream:
            return self.dataset[item]
        index, row = item
        return row if self.finish_row is None else self.finish_row(row, index)

    def _read(self, item: Any) -> tuple[Any, str | None]:
        error: Exception | None = None
        for _ in range(self.max_retries + 1):
            try:
                return self._read_once(item), None
            except UserError:
                raise
            except Exception as exc:  # a flaky read (a lazy or remote dataset): try again
                error = exc
        where = item[0] if self.stream else item
        reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
        return None, f"row {where} ({type(error).__name__}: {reason})"
