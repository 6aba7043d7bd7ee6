"""``ToolManager``: the tools one trajectory may call, by name; runs calls and never raises.

Every failure is an observation for the model instead of an exception for the run, because a
policy being trained writes bad calls and one bad call must not stop a batch of rollouts:

- a reply whose calls cannot be read (``malformed``), a call to a tool not offered
  (``unknown_tool``), arguments that fail the tool's JSON schema (``bad_arguments``), a tool that
  raises (``raised``) or runs past ``timeout`` seconds (``timeout``): the observation says what
  went wrong (``Error: ...``) and ``ToolOutcome.error`` names the kind, which the rollout counts.

A call that times out is left running on a daemon thread (Python cannot stop a thread); its
result, if it ever comes, is dropped."""

import json
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from twinkle.utils.errors import UserError
from twinkle_agentic.tools.base import ToolOutcome
from twinkle_agentic.tools.formats import ToolCallFormat, get_format, parse_tool_calls
from twinkle_agentic.tools.schema import validate_arguments


def tool_name_of(tool: Any) -> str:
    """``tool_info()["function"]["name"]``, or a one-line error."""
    info = tool.tool_info() if hasattr(tool, "tool_info") else None
    function = info.get("function") if isinstance(info, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str) or not name:
        raise UserError(f"tool {type(tool).__name__}: tool_info() needs a non-empty ['function']['name']")
    return name


class ToolManager:
    """``tools``: a list of tools (each named by its ``tool_info()``) or a dict name -> tool;
    ``timeout``: seconds a call may run (None: no limit); ``format``: the chat format calls are
    written in and results shown back in (``TOOL_FORMATS``)."""

    def __init__(
        self,
        tools: Iterable[Any] | Mapping[str, Any] | None = None,
        timeout: float | None = 30.0,
        format: str | ToolCallFormat = "hermes",
    ):
        if timeout is not None and timeout <= 0:
            raise UserError(f"ToolManager(timeout={timeout}): a timeout must be > 0 seconds, or None")
        self.timeout = timeout
        self.format = get_format(format)
        self._tools: dict[str, Any] = {}
        if isinstance(tools, Mapping):
            self._tools.update(tools)
        else:
            for tool in tools or []:
                self.register(tool)

    def register(self, tool: Any) -> None:
        self._tools[tool_name_of(tool)] = tool

    def unregister(self, name: str) -> Any:
        return self._tools.pop(name, None)

    def names(self) -> list[str]:
        return list(self._tools)

    def copy(self) -> "ToolManager":
        return ToolManager(dict(self._tools), timeout=self.timeout, format=self.format)

    def tool_infos(self) -> list[dict[str, Any]]:
        return [t.tool_info() for t in self._tools.values()]

    def tools_prompt(self) -> str:
        """The tool list and call instructions in this manager's format (for the system turn)."""
        return self.format.tools_prompt(self.tool_infos())

    # ----------------------------------------------------------------- calls
    def parse(self, text: str) -> tuple[list[dict[str, Any]], list[str]]:
        """The calls in a reply and the errors of what could not be read (``parse_tool_calls``)."""
        return parse_tool_calls(text)

    def __call__(self, tool_call: Any) -> str:
        """Upstream's call: one OpenAI-shaped tool call -> the observation text."""
        return self.execute(tool_call).content

    def execute(self, tool_call: Any) -> ToolOutcome:
        """Run one call (``{"function": {"name", "arguments"}}``, arguments a dict or JSON text)."""
        function = tool_call.get("function") if isinstance(tool_call, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str) or not name:
            return _error("malformed", f"a tool call needs a function name, got {tool_call!r:.80}")
        tool = self._tools.get(name)
        if tool is None:
            known = ", ".join(sorted(self._tools)) or "none"
            return _error("unknown_tool", f"there is no tool {name!r}; the tools are: {known}")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as exc:
                return _error("malformed", f"the arguments of {name!r} are not valid JSON ({exc.msg})")
        arguments = {} if arguments is None else arguments
        schema = tool.tool_info()["function"].get("parameters")
        problem = validate_arguments(arguments, schema if isinstance(schema, dict) else None)
        if problem:
            return _error("bad_arguments", f"{name}: {problem}")
        return self._run(tool, name, arguments)

    def execute_reply(self, text: str) -> tuple[list[ToolOutcome], bool]:
        """Run every call in a reply, in order, after one outcome per part that could not be
        read; ``(outcomes, whether the reply asked for anything)``. An empty list with False is a
        final answer."""
        calls, errors = self.parse(text)
        outcomes = [_error("malformed", f"{e}; write calls as the system prompt shows") for e in errors]
        outcomes += [self.execute(call) for call in calls]
        return outcomes, bool(calls or errors)

    def _run(self, tool: Any, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = tool.step(name, arguments) if hasattr(tool, "step") else tool(name, arguments)
            except BaseException as exc:  # a tool's failure is the model's observation
                box["error"] = exc

        worker = threading.Thread(target=target, name=f"tool-{name}", daemon=True)
        worker.start()
        worker.join(self.timeout)
        if worker.is_alive():
            return _error("timeout", f"{name} did not finish within {self.timeout:g} s")
        if "error" in box:
            exc = box["error"]
            return _error("raised", f"{name} failed: {type(exc).__name__}: {exc}")
        value = box.get("value")
        if hasattr(value, "observation"):  # an environment step
            return ToolOutcome(
                str(value.observation),
                float(getattr(value, "reward", 0.0) or 0.0),
                bool(getattr(value, "done", False)),
                info=dict(getattr(value, "info", None) or {}),
            )
        return ToolOutcome("" if value is None else str(value))


def _error(kind: str, message: str) -> ToolOutcome:
    return ToolOutcome(f"Error: {message}", error=kind)
