"""``Message`` (one turn of a conversation) and the tool records a turn may carry."""

from typing import Any, Literal, TypedDict


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

    ``images``: images given with the turn, each a file path, the file's bytes, a PIL image, or
    a ``{'bytes': ..., 'path': ...}`` record as Hugging Face ``datasets`` stores images; a URL is
    refused (nothing is downloaded). A vision-language template (``Qwen2_5VLTemplate``) takes the
    images of all turns in order and puts them where the user turns write ``<image>``, in order;
    images beyond the tags go before the text of the first user turn, and a tag without an
    image is an error.

    Example: ``{'role': 'user', 'content': 'Who are you?'}``,
    ``{'role': 'user', 'content': '<image>What digit is this?', 'images': ['seven.png']}``."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_calls: list[ToolCall]
    reasoning_content: str
    images: list[Any]
