"""``kind_of``: a value's type as a JSON reader names it, for messages about data rows."""

from typing import Any


def kind_of(value: Any) -> str:
    """``null``, ``a boolean (True)``, ``a number (42)``, ``text``, ``a list``, ``an object``; the
    value itself is shown only when it is short."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({value})"
    if isinstance(value, int | float):
        shown = repr(value)
        return f"a number ({shown})" if len(shown) <= 20 else "a number"
    if isinstance(value, str):
        return "text"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"
