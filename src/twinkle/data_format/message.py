"""``Message`` (one turn of a conversation) and the tool records a turn may carry."""

from typing import Literal, TypedDict


class ToolCall(TypedDict, total=False):
    """A tool the assistant calls: its ``tool_name`` and its ``arguments`` as JSON text."""

    tool_name: str
    arguments: str


class Tool(TypedDict, total=False):
    """A tool offered to the model: ``tool_name``, ``description`` and ``parameters`` (the JSON
    schema of its arguments, as JSON text)."""

    tool_name: str
    description: str
    parameters: str


class Message(TypedDict, total=False):
    """One turn: ``role`` and its text ``content``; an assistant turn may carry ``tool_calls``
    and ``reasoning_content`` (the thinking written before the reply).

    Example: ``{'role': 'user', 'content': 'Who are you?'}``."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_calls: list[ToolCall]
    reasoning_content: str
