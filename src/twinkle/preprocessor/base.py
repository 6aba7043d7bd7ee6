"""The preprocessor interface: ``row -> {'messages': [...]}``."""

from typing import Any

from twinkle.utils.errors import UserError

ROLES = ("system", "user", "assistant")


def require_fields(row: dict[str, Any], fields: tuple[str, ...], index: int | None) -> None:
    missing = [f for f in fields if not isinstance(row.get(f), str)]
    if missing:
        where = f"row {index}" if index is not None else "a row"
        # Rows of one file share columns (a key missing from a row reads as None): list only
        # the fields this row really fills.
        present = sorted(key for key, value in row.items() if value is not None)
        raise UserError(
            f"{where} has no text field(s) {', '.join(missing)} (it has {', '.join(present) or 'no fields'}); "
            f"every row needs {', '.join(fields)}"
        )


class Preprocessor:
    """Subclasses implement ``__call__(row, index=None) -> {'messages': [...]}``."""

    def __call__(self, row: dict[str, Any], index: int | None = None) -> dict[str, Any]:
        raise NotImplementedError


class MessagesProcessor(Preprocessor):
    """Rows that already hold ``messages`` (a list of ``{'role', 'content'}``): validate them."""

    def __call__(self, row: dict[str, Any], index: int | None = None) -> dict[str, Any]:
        messages = row.get("messages")
        where = f"row {index}" if index is not None else "a row"
        if not isinstance(messages, list) or not messages:
            raise UserError(f"{where} has no 'messages' list")
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise UserError(
                    f"{where}: each message needs a role in {ROLES} and a text content, got {m!r}"
                )
        return {"messages": [{"role": m["role"], "content": m["content"]} for m in messages]}
