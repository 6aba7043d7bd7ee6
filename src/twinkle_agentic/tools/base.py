"""``Tool`` (what the model may call), ``FunctionTool`` (a Python function as a tool) and
``ToolOutcome`` (what one call gave back).

A tool is described to the model in OpenAI's function shape, ``{"type": "function", "function":
{"name", "description", "parameters"}}``, where ``parameters`` is the JSON schema of its
arguments: the form chat templates and tool-calling datasets use."""

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Why a call gave an error observation instead of a result (the keys of the rollout's counts).
ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout")


@dataclass
class ToolOutcome:
    """One call's result: the text the model reads next (``content``), the environment's
    ``reward`` and ``done`` (plain tools: 0 and False), and ``error``, one of ``ERROR_KINDS``
    when the call failed (its ``content`` then says why, for the model to read)."""

    content: str
    reward: float = 0.0
    done: bool = False
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)


class Tool(ABC):
    """Upstream's protocol: ``tool(tool_name, arguments) -> str`` and ``tool_info()``. A tool
    that also has ``step(tool_name, arguments)`` returning a ``StepResult``-like object (an
    environment step) reports a reward and the end of the episode through it."""

    @abstractmethod
    def __call__(self, tool_name: str, arguments: dict[str, Any]) -> str:
        raise NotImplementedError

    @abstractmethod
    def tool_info(self) -> dict[str, Any]:
        raise NotImplementedError


def function_info(name: str, description: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A tool's description in OpenAI's function shape."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": parameters or {"type": "object", "properties": {}},
        },
    }


class FunctionTool(Tool):
    """``fn(**arguments)`` as a tool named ``name``; its return value is the observation (made
    text with ``str``). ``parameters``: the JSON schema the arguments are checked against."""

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str | None = None,
        description: str = "",
        parameters: dict[str, Any] | None = None,
    ):
        self.fn = fn
        self.name = name or fn.__name__
        self.description = description or (fn.__doc__ or "").strip()
        self.parameters = parameters

    def __call__(self, tool_name: str, arguments: dict[str, Any]) -> str:
        return str(self.fn(**arguments))

    def tool_info(self) -> dict[str, Any]:
        return function_info(self.name, self.description, self.parameters)
