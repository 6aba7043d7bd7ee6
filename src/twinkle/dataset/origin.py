"""``RowOrigin``: which file, line and row each row of a loaded dataset came from, so that a
bad row is named where the user can find it (``data.jsonl:12: row 11: ...``) even after
``data_slice`` picked and repeated rows.

It follows the rows through every step that keeps track of them (slicing, preprocessing, rows
dropped by ``--skip-bad-rows``, concatenation, encoding). After a step that cannot say which
rows it kept (``filter``, an interleaving mix, a batched function that changes the row count)
the rows are numbered where they stand, under a name that says so."""

from collections.abc import Sequence

import numpy as np

from twinkle.hub.dataset import RowSource
from twinkle.hub.jsonrows import SKIP_HINT
from twinkle.preprocessor.base import BadRow
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

logger = get_logger()
_LISTED = 3  # bad rows quoted in the summary line; the rest are counted


class RowOrigin:
    """For each row ``i``: ``sources[source_of[i]]`` and the row number in that source."""

    def __init__(self, sources: Sequence[RowSource], source_of: np.ndarray, record_of: np.ndarray):
        self.sources = list(sources)
        self.source_of = source_of
        self.record_of = record_of

    @classmethod
    def of_sources(cls, sources: Sequence[RowSource]) -> "RowOrigin":
        """Rows laid out as ``sources`` list them, one after another."""
        counts = [s.count for s in sources]
        source_of = np.repeat(np.arange(len(sources), dtype=np.int32), counts)
        record_of = np.concatenate([np.arange(n, dtype=np.int64) for n in counts] or [np.zeros(0, np.int64)])
        return cls(sources, source_of, record_of)

    @classmethod
    def in_place(cls, name: str, count: int) -> "RowOrigin":
        """``count`` rows named by their position, under ``name``."""
        return cls.of_sources([RowSource(name, count)])

    def __len__(self) -> int:
        return len(self.record_of)

    def take(self, indices: Sequence[int]) -> "RowOrigin":
        """The origin of rows ``indices`` of these rows, in that order."""
        picked = np.asarray(indices, dtype=np.int64)
        return RowOrigin(self.sources, self.source_of[picked], self.record_of[picked])

    @staticmethod
    def concat(origins: Sequence["RowOrigin"]) -> "RowOrigin":
        if len(origins) == 1:
            return origins[0]
        sources, source_of = [], []
        for origin in origins:
            source_of.append(origin.source_of + len(sources))
            sources += origin.sources
        return RowOrigin(sources, np.concatenate(source_of), np.concatenate([o.record_of for o in origins]))

    def where(self, i: int) -> str:
        """``<file>:<line>: row <n>`` for a JSON-lines row, else ``<source>: row <n>``; ``n``
        counts the source's rows from 0, as ``dataset[n]`` does."""
        if not 0 <= i < len(self):
            return f"row {i}"
        return self.sources[int(self.source_of[i])].where(int(self.record_of[i]))


def located(exc: BadRow, origin: RowOrigin) -> UserError:
    """``exc`` as one line naming the row's file, line and row number, and the two fixes."""
    where = origin.where(exc.index) if exc.index is not None else "a row"
    return UserError(f"{exc.at(where)}; fix the row, {SKIP_HINT}")


def bad_rows_text(bad: Sequence[tuple[int, BadRow]], origin: RowOrigin) -> list[str]:
    """Each bad row as ``<file>:<line>: row <n>: <what is wrong>``."""
    return [exc.at(origin.where(i)) for i, exc in bad]


def describe_skipped(skipped: Sequence[str], count: int, total: int, step: str) -> str:
    """One line: how many (``count``) of ``total`` rows ``step`` dropped, and the first few
    different ones (a row ``data_slice`` repeats is dropped each time it comes)."""
    first = list(dict.fromkeys(skipped))[:_LISTED]
    return f"--skip-bad-rows: {step} dropped {count} of {total} rows; the first: {' | '.join(first)}"


def report_skipped(skipped: Sequence[str], count: int, total: int, step: str) -> None:
    """Log the rows ``skip_bad_rows`` dropped in one line (never silently); that every row is
    bad is an error."""
    if not count:
        return
    if count >= total:
        raise UserError(
            f"every one of the {total} rows is bad, nothing is left to train on; the first: {skipped[0]}"
        )
    logger.warning(describe_skipped(skipped, count, total, step))
