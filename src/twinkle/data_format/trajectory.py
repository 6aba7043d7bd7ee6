"""``Trajectory``: a conversation as a preprocessor hands it to a template."""

from typing import Any, TypedDict

from twinkle.data_format.message import Message, Tool


class Trajectory(TypedDict, total=False):
    """``messages``: the turns, in order (the assistant turns are what a template supervises);
    ``tools``: the tools offered; ``user_data``: anything else a recipe needs carried along
    (a KTO label, a reward).

    Example: ``{'messages': [{'role': 'user', 'content': 'Hi'}, {'role': 'assistant',
    'content': 'Hello!'}]}``."""

    messages: list[Message]
    tools: list[Tool]
    user_data: dict[str, Any]
