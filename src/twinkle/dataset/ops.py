"""Row operations behind ``Dataset.map`` and ``Dataset.filter``, on Hugging Face ``datasets``.

Every operation runs in memory (``keep_in_memory``): Hugging Face's own cache is keyed by a
hash of the function, which cannot see a change inside a preprocessor's code. Encoded rows,
the one costly step, have their own content-keyed cache (``twinkle.dataset.cache``).

Each operation also carries the rows' ``RowOrigin`` along, so that a row a preprocessor finds
bad (``BadRow``) is named by its file and line, or, with ``skip_bad_rows``, dropped and listed."""

import os
from collections.abc import Callable, Sequence
from typing import Any

import datasets
from datasets.fingerprint import generate_random_fingerprint

from twinkle.dataset.image_rows import storable, storable_columns
from twinkle.dataset.origin import RowOrigin, located
from twinkle.preprocessor.base import BadRow, DataFilter, Preprocessor, per_row, row_core
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

logger = get_logger()
# The position each output row had in the input: how the origin follows rows a map drops.
ROW_COLUMN = "__twinkle_row__"
BadRows = list[tuple[int, BadRow]]  # (position in the input rows, what is wrong)


def reject_unsupported(method: str, unsupported: dict[str, Any]) -> None:
    """Upstream passes any other keyword on to ``datasets``; here each one is named and refused."""
    if unsupported:
        names = ", ".join(sorted(unsupported))
        raise UserError(f"Dataset.{method}: not supported yet: {names}; remove the keyword")


def cap_num_proc(num_proc: int | None, rows: int, what: str) -> int | None:
    """Worker processes for ``datasets``: at most one per row and per usable CPU; None is one."""
    if num_proc is None:
        return None
    if num_proc < 1:
        raise UserError(f"Dataset.{what}: num_proc must be at least 1, got {num_proc}")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    capped = max(1, min(num_proc, rows, cpus))
    if capped < num_proc:
        logger.info(f"Dataset.{what}: num_proc={num_proc} capped to {capped} ({rows} rows, {cpus} CPUs)")
    return capped if capped > 1 else None


def resolve_function(fn: Any, init_args: dict[str, Any] | None, what: str) -> Callable[..., Any]:
    """A function, a callable instance, a class (built with ``init_args``) or the name of a
    class in ``twinkle.preprocessor`` (a ``Preprocessor`` for ``map``, a ``DataFilter`` for
    ``filter``)."""
    if isinstance(fn, str):
        import twinkle.preprocessor as registry

        base = DataFilter if what == "filter" else Preprocessor
        classes = {n: getattr(registry, n) for n in registry.__all__}
        names = [
            n for n, c in classes.items() if isinstance(c, type) and issubclass(c, base) and c is not base
        ]
        if fn not in names:
            raise UserError(
                f"Dataset.{what}: unknown {base.__name__} {fn!r}; valid names: {', '.join(names) or 'none'}"
            )
        fn = classes[fn]
    if isinstance(fn, type):
        try:
            return fn(**(init_args or {}))
        except TypeError as exc:
            raise UserError(f"Dataset.{what}: cannot build {fn.__name__} from init_args ({exc})") from exc
    if init_args:
        raise UserError(
            f"Dataset.{what}: init_args builds a class, but {fn!r} is already built; drop init_args"
        )
    if not callable(fn):
        raise UserError(f"Dataset.{what}: expected a function or preprocessor, got {type(fn).__name__}")
    return fn


def row_function(fn: Callable[..., Any]) -> Callable[[dict[str, Any], int | None], Any]:
    """``fn`` as ``(row, index) -> row or None``: a per-row ``Preprocessor``'s ``preprocess``
    (its ``BadRow`` names the row), a batched one called on a batch of that one row, or a
    function of the row."""
    if per_row(fn):
        return row_core(fn)
    if isinstance(fn, Preprocessor):
        return lambda row, index: _one_row(fn({key: [value] for key, value in row.items()}), index)
    return lambda row, index: fn(row)


def _one_row(columns: Any, index: int | None) -> dict[str, Any] | None:
    if not isinstance(columns, dict):
        raise UserError(f"a Preprocessor returned {type(columns).__name__}; return a dict of column lists")
    rows = Preprocessor.map_col_to_row(columns)
    if len(rows) > 1:
        raise UserError(
            f"row {index}: the Preprocessor made {len(rows)} rows of one; a row read on its own "
            "(a stream, LazyDataset) must give one row or none"
        )
    return rows[0] if rows else None


def _rows(batch: dict[str, list]) -> list[dict[str, Any]]:
    n = len(next(iter(batch.values()))) if batch else 0
    return [{key: values[i] for key, values in batch.items()} for i in range(n)]


class RowMapper:
    """Calls ``fn`` on each row of a batch (``row_function``: a ``Preprocessor``'s per-row
    ``preprocess(row, index)``, whose error messages name the row, or ``fn(row)``). ``None`` drops the row, and so does a
    ``BadRow`` with ``skip_bad_rows``. The columns are fixed up front (``keys``), so a batch
    whose rows all drop still has them; ``ROW_COLUMN`` records where each kept row came from."""

    def __init__(
        self, fn: Callable[..., Any], keep: Sequence[str], keys: Sequence[str], skip_bad_rows: bool = False
    ):
        self.fn = row_function(fn)
        self.keep = set(keep)
        self.keys = list(keys)
        self.skip_bad_rows = skip_bad_rows

    def call(self, row: dict[str, Any], index: int) -> dict[str, Any] | None:
        out = self.fn(row, index)
        if out is not None and not isinstance(out, dict):
            raise UserError(
                f"Dataset.map: row {index}: the function returned {type(out).__name__}; return a dict, or None to drop the row"
            )
        return None if out is None else storable(out, index)

    def call_or_skip(self, row: dict[str, Any], index: int) -> dict[str, Any] | None:
        try:
            return self.call(row, index)
        except BadRow:
            if self.skip_bad_rows:
                return None
            raise

    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        columns: dict[str, list] = {key: [] for key in [*self.keys, ROW_COLUMN]}
        for row, index in zip(_rows(batch), indices, strict=True):
            out = self.call_or_skip(row, index)
            if out is None:
                continue
            extra = set(out) - set(self.keys)
            if extra:
                raise UserError(
                    f"Dataset.map: row {index} returned the column(s) {', '.join(sorted(extra))} that earlier rows "
                    "did not; return the same keys from every row"
                )
            for key in self.keys:
                columns[key].append(out[key] if key in out else row[key] if key in self.keep else None)
            columns[ROW_COLUMN].append(index)
        return columns


class BatchMapper:
    """Calls ``fn(batch)`` on a dict of column lists, as ``datasets`` does with ``batched=True``;
    input columns it does not return are kept (unless removed), so it must then keep the rows."""

    def __init__(self, fn: Callable[..., Any], keep: Sequence[str]):
        self.fn = fn
        self.keep = list(keep)

    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        out = self.fn(batch)
        if not isinstance(out, dict) or not all(isinstance(v, list) for v in out.values()):
            raise UserError("Dataset.map(batched=True): the function must return a dict of column lists")
        keep = [key for key in self.keep if key not in out]
        lengths = {len(v) for v in out.values()}
        if keep and lengths and lengths != {len(indices)}:
            raise UserError(
                f"Dataset.map(batched=True): the function returned {max(lengths)} rows for {len(indices)}; "
                f"pass remove_columns={keep} (the input columns it does not return)"
            )
        return {**{key: batch[key] for key in keep}, **storable_columns(out, indices)}


def map_rows(
    data: datasets.Dataset,
    fn: Callable[..., Any],
    batched: bool,
    batch_size: int,
    remove_columns: Sequence[str] | str | None,
    num_proc: int | None,
    origin: RowOrigin | None = None,
    skip_bad_rows: bool = False,
) -> tuple[datasets.Dataset, RowOrigin, BadRows]:
    """``fn`` over ``data``, the origin of the rows it returns, and the rows ``skip_bad_rows``
    dropped. A ``Preprocessor`` replaces every column with what it returns; a function's output
    is merged into the row, minus ``remove_columns``. Without ``skip_bad_rows`` a ``BadRow``
    is raised again as a ``UserError`` naming the row's file and line."""
    origin = origin if origin is not None else RowOrigin.in_place("the rows", len(data))
    try:
        return _map_rows(data, fn, batched, batch_size, remove_columns, num_proc, origin, skip_bad_rows)
    except BadRow as exc:
        raise located(exc, origin) from exc


def _map_rows(
    data: datasets.Dataset,
    fn: Callable[..., Any],
    batched: bool,
    batch_size: int,
    remove_columns: Sequence[str] | str | None,
    num_proc: int | None,
    origin: RowOrigin,
    skip_bad_rows: bool,
) -> tuple[datasets.Dataset, RowOrigin, BadRows]:
    columns = data.column_names
    removed = [remove_columns] if isinstance(remove_columns, str) else list(remove_columns or [])
    unknown = [c for c in removed if c not in columns]
    if unknown:
        raise UserError(f"Dataset.map: remove_columns names {unknown}, which are not columns ({columns})")
    keep = [] if isinstance(fn, Preprocessor) else [c for c in columns if c not in removed]
    # A per-row preprocessor runs row by row whatever ``batched`` says (the result is the same);
    # upstream's shape takes the batch as columns, of one row each unless ``batched``.
    by_columns = isinstance(fn, Preprocessor) and not per_row(fn)
    if by_columns or (batched and not per_row(fn)):
        mapper: Any = BatchMapper(fn, keep)
        batch_size = batch_size if batched or not by_columns else 1
    else:
        probe = RowMapper(fn, keep, [], skip_bad_rows)
        first = next(
            ((i, out) for i in range(len(data)) if (out := probe.call_or_skip(data[i], i)) is not None),
            None,
        )
        if first is None:  # every row dropped
            empty = data.select([]).remove_columns([c for c in columns if c not in keep])
            return empty, origin.take([]), _bad_rows(data, probe, range(len(data)))
        mapper = RowMapper(fn, keep, list(dict.fromkeys([*first[1], *keep])), skip_bad_rows)
    mapped = data.map(
        mapper,
        batched=True,
        batch_size=batch_size,
        with_indices=True,
        remove_columns=columns,
        keep_in_memory=True,
        num_proc=cap_num_proc(num_proc, len(data), "map"),
        new_fingerprint=generate_random_fingerprint(),
        desc="preprocess",
    )
    if isinstance(mapper, BatchMapper):  # a batched function does not say which rows it kept
        same = len(mapped) == len(data)
        return mapped, origin if same else RowOrigin.in_place("the rows after a batched map", len(mapped)), []
    kept = mapped[ROW_COLUMN]
    mapped = mapped.remove_columns([ROW_COLUMN])
    dropped = sorted(set(range(len(data))) - set(kept)) if skip_bad_rows and len(kept) < len(data) else []
    return mapped, origin.take(kept), _bad_rows(data, mapper, dropped)


def _bad_rows(data: datasets.Dataset, mapper: RowMapper, dropped: Sequence[int]) -> BadRows:
    """Which of the ``dropped`` rows were dropped as bad, and why (the function runs again on
    them, here, because worker processes cannot report back; rows it returned None for are the
    function's own choice and not counted)."""
    if not mapper.skip_bad_rows:
        return []
    bad: BadRows = []
    for i in dropped:
        try:
            mapper.call(data[i], i)
        except BadRow as exc:
            bad.append((i, exc))
    return bad


def filter_rows(
    data: datasets.Dataset, fn: Callable[..., Any], batched: bool, batch_size: int, num_proc: int | None
) -> datasets.Dataset:
    """Keep the rows for which ``fn(row)`` is true (``fn(batch)`` gives one bool per row when batched)."""
    return data.filter(
        fn,
        batched=batched,
        batch_size=batch_size,
        keep_in_memory=True,
        num_proc=cap_num_proc(num_proc, len(data), "filter"),
        new_fingerprint=generate_random_fingerprint(),
        desc="filter",
    )
