"""The preprocessor interface, in upstream's call shape: ``Preprocessor.__call__(rows)`` takes a
batch of rows as columns (``{'query': [...], 'response': [...]}``) and returns columns; a
subclass writes either that ``__call__`` or the per-row ``preprocess(row, index=None)`` that
the base ``__call__`` runs on each row. ``DataFilter``: ``__call__(row) -> bool``. And
``BadRow``, the error a row that cannot become a training sample raises, with the checks that
raise it."""

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from twinkle.utils.errors import UserError
from twinkle.utils.values import kind_of

ROLES = ("system", "user", "assistant")
# Roles whose text must not be empty: an empty question or reply teaches nothing.
SPOKEN_ROLES = ("user", "assistant")


class BadRow(UserError):
    """Row ``index`` cannot be trained on because of ``field``.

    The message is ``row <index><text>`` (``text`` starts with a space or a colon). ``Dataset``
    knows which file and line the row came from and re-raises it as ``<file>:<line>: row
    <n><text>``, or, with ``skip_bad_rows``, drops the row and counts it."""

    def __init__(self, index: int | None, field: str, text: str):
        self.index, self.field, self.text = index, field, text
        where = f"row {index}" if index is not None else "a row"
        super().__init__(f"{where}{text}")

    def __reduce__(self) -> tuple:  # worker processes (``num_proc``) send it back to the parent
        return (type(self), (self.index, self.field, self.text))

    def at(self, where: str) -> str:
        """The message with ``where`` (a file, line and row) in place of ``row <index>``."""
        return f"{where}{self.text}"


def require_fields(row: dict[str, Any], fields: tuple[str, ...], index: int | None) -> None:
    """Each of ``fields`` holds non-empty text."""
    needs = f"every row needs text in {', '.join(fields)}"
    missing = [f for f in fields if row.get(f) is None]
    if missing:
        # Rows of one file share columns (a key missing from a row reads as None): list only
        # the fields this row really fills.
        present = sorted(key for key, value in row.items() if value is not None)
        raise BadRow(
            index,
            missing[0],
            f" has no text field(s) {', '.join(missing)} (it has {', '.join(present) or 'no fields'}); "
            f"every row needs {', '.join(fields)}",
        )
    for name in fields:
        value = row[name]
        if not isinstance(value, str):
            raise BadRow(index, name, f": {name!r} is {kind_of(value)}, not text; {needs}")
        if not value.strip():
            raise BadRow(index, name, f": {name!r} is empty; {needs}")


def check_messages(
    messages: Any, index: int | None, roles: tuple[str, ...] = ROLES, need_reply: bool = True
) -> None:
    """``messages`` is a non-empty list of ``{'role', 'content'}`` with a known role and text
    content (empty only for roles outside ``SPOKEN_ROLES``), holding an assistant reply after
    another turn (with ``need_reply``: the template supervises only such replies).

    ``ToolCallProcessor`` checks its own rows (tool calls may stand in for the content)."""
    if not isinstance(messages, list):
        text = (
            " has no 'messages' list"
            if messages is None
            else f": 'messages' is {kind_of(messages)}, not a list"
        )
        raise BadRow(index, "messages", text)
    if not messages:
        raise BadRow(index, "messages", " has no 'messages' list (it is empty)")
    for i, m in enumerate(messages):
        field = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRow(index, field, f": {field} is {kind_of(m)}, not a message {{'role', 'content'}}")
        role, content = m.get("role"), m.get("content")
        if role not in roles:
            raise BadRow(
                index, f"{field}.role", f": {field}.role is {role!r}; each message needs a role in {roles}"
            )
        if not isinstance(content, str):
            raise BadRow(
                index, f"{field}.content", f": {field}.content ({role}) is {kind_of(content)}, not text"
            )
        if role in SPOKEN_ROLES and not content.strip():
            raise BadRow(index, f"{field}.content", f": {field}.content ({role}) is empty")
    if need_reply and not any(m["role"] == "assistant" for m in messages[1:]):
        raise BadRow(
            index,
            "messages",
            ": 'messages' has no assistant turn after the first message, so nothing is learnt; "
            "add the reply to train on",
        )


class Preprocessor:
    """Rows -> rows, as ``Dataset.map`` runs it. Subclass it one of two ways:

    - ``preprocess(self, row, index=None) -> dict | None``: one row in, its new columns out
      (``{'messages': [...]}``), None to drop it. ``Dataset`` then calls it row by row, so a
      ``BadRow`` it raises names the row's file and line (or is dropped with
      ``skip_bad_rows``). The built-in processors are written this way.
    - ``__call__(self, rows: dict[str, list]) -> dict[str, list]``: a batch as columns in, the
      new columns out (any number of rows), as upstream's processors are written; the helpers
      ``map_col_to_row`` and ``map_row_to_col`` convert between the two layouts.

    Either way the instance is called as ``processor(columns)``; what it returns replaces all
    of the rows' columns, so raw fields do not reach the template."""

    @staticmethod
    def map_col_to_row(rows: Mapping[str, list] | list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Columns (``{'a': [1, 2]}``) -> rows (``[{'a': 1}, {'a': 2}]``); rows as they are."""
        if isinstance(rows, list):
            return rows
        if not rows:
            return []
        if not all(isinstance(values, list | tuple) for values in rows.values()):
            raise UserError(
                "a Preprocessor is called with columns ({'key': [value, ...]}), got a row; "
                "call preprocess(row) or processor(row, index) for one row"
            )
        lengths = {len(values) for values in rows.values()}
        if len(lengths) != 1:
            raise UserError(
                f"map_col_to_row: columns of different lengths {sorted(lengths)}; give equal-length lists"
            )
        return [dict(zip(rows, values, strict=True)) for values in zip(*rows.values(), strict=True)]

    @staticmethod
    def map_row_to_col(
        rows: list[Mapping[str, Any]] | dict[str, list], keys: list[str] | None = None
    ) -> dict[str, list]:
        """Rows -> columns; columns as they are. ``keys``: the columns to make (default: every key
        any row has, a row without one giving None there)."""
        if isinstance(rows, dict):
            return rows
        if keys is None:
            keys = list(dict.fromkeys(key for row in rows for key in row))
        return {key: [row.get(key) for row in rows] for key in keys}

    def preprocess(self, row: dict[str, Any], index: int | None = None) -> dict[str, Any] | None:
        raise NotImplementedError(
            f"{type(self).__name__} implements neither preprocess(row, index=None) nor __call__(rows)"
        )

    def __call__(self, rows: dict[str, list], index: int | None = None) -> Any:
        """``processor(columns)``: upstream's shape, columns in and out. ``processor(row, index)``
        (the index given) is one row through ``preprocess``: a row's values may be lists, so
        without the index a dict is always read as columns."""
        core = row_core(self)
        if index is not None:
            return core(rows, index)
        out = [new for row in self.map_col_to_row(rows) if (new := core(row, None)) is not None]
        return self.map_row_to_col(out)


def per_row(fn: Any) -> bool:
    """Whether ``fn`` is a ``Preprocessor`` whose work is its per-row ``preprocess`` (its class
    keeps the base ``__call__``), so that a dataset may call it row by row."""
    return isinstance(fn, Preprocessor) and type(fn).__call__ is Preprocessor.__call__


def row_core(fn: Preprocessor) -> Callable[[dict[str, Any], int | None], dict[str, Any] | None]:
    """``fn.preprocess`` as ``(row, index)``: upstream's ``preprocess(row)`` takes no index."""
    method = fn.preprocess
    try:
        takes_index = len(inspect.signature(method).parameters) >= 2
    except (TypeError, ValueError):
        takes_index = True
    return method if takes_index else (lambda row, index: method(row))


class DataFilter:
    """Upstream's filter interface: ``__call__(row) -> bool``, True keeping the row
    (``Dataset.filter`` takes an instance, a subclass built with ``init_args`` or its name)."""

    def __call__(self, row: dict[str, Any]) -> bool:
        raise NotImplementedError(f"{type(self).__name__} does not implement __call__(row) -> bool")


class MessagesProcessor(Preprocessor):
    """Rows that already hold ``messages`` (a list of ``{'role', 'content'}``): validate them."""

    def preprocess(self, row: dict[str, Any], index: int | None = None) -> dict[str, Any]:
        messages = row.get("messages")
        check_messages(messages, index)
        return {"messages": [{"role": m["role"], "content": m["content"]} for m in messages]}
