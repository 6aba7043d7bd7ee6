"""The preprocessor interface: ``row -> {'messages': [...]}``; and ``BadRow``, the error a row
that cannot become a training sample raises, with the checks that raise it."""

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
    """Subclasses implement ``__call__(row, index=None) -> {'messages': [...]}``. A row that
    cannot become a sample raises ``BadRow`` naming its field."""

    def __call__(self, row: dict[str, Any], index: int | None = None) -> dict[str, Any]:
        raise NotImplementedError


class MessagesProcessor(Preprocessor):
    """Rows that already hold ``messages`` (a list of ``{'role', 'content'}``): validate them."""

    def __call__(self, row: dict[str, Any], index: int | None = None) -> dict[str, Any]:
        messages = row.get("messages")
        check_messages(messages, index)
        return {"messages": [{"role": m["role"], "content": m["content"]} for m in messages]}
