"""The formats chat models write tool calls in, and how their results are shown back.

Public names: ``ToolCallFormat``, ``TOOL_FORMATS``, ``get_format``, ``parse_tool_calls``.

Every format below wraps a call in ``<tool_call>...</tool_call>``; what is inside differs:

- ``hermes`` (Hermes, Qwen2.5, Qwen3): one JSON object ``{"name": ..., "arguments": {...}}`` per
  block; results come back in a user turn as ``<tool_response>`` blocks;
- ``smollm2`` (SmolLM2-Instruct): a JSON list of such objects in one block; results come back as
  a ``tool`` turn;
- ``qwen3_5`` (Qwen3.5): ``<function=NAME>`` with one ``<parameter=KEY>`` per argument
  (``twinkle.template.tools``); results as in ``hermes``.

``parse_tool_calls`` reads all three, so a model that drifts from its own format is still
understood; what cannot be read becomes an error the model is told about, never an exception."""

import json
import re
from dataclasses import dataclass
from typing import Any

from twinkle.template.tools import tools_block
from twinkle.utils.errors import UserError

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _call(name: Any, arguments: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _from_json(item: Any) -> dict[str, Any] | str:
    """One JSON call (``{"name", "arguments"}`` or OpenAI's ``{"function": {...}}``), or why not."""
    if not isinstance(item, dict):
        return f"a tool call must be a JSON object with 'name' and 'arguments', got {json.dumps(item)[:80]}"
    item = item.get("function", item) if isinstance(item.get("function"), dict) else item
    name = item.get("name")
    if not isinstance(name, str) or not name:
        return f"a tool call needs a 'name', got {json.dumps(item)[:80]}"
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return f"the arguments of {name!r} are not valid JSON ({exc.msg})"
    return _call(name, arguments)


def _from_xml(body: str) -> list[dict[str, Any] | str]:
    found = _FUNCTION.findall(body)
    if not found:
        return [f"a <tool_call> block holds neither JSON nor a <function=...> element: {body.strip()[:80]!r}"]
    out: list[dict[str, Any] | str] = []
    for name, inner in found:
        arguments: dict[str, Any] = {}
        for key, raw in _PARAMETER.findall(inner):
            try:  # numbers, lists and objects come as JSON text, anything else as text
                arguments[key] = json.loads(raw)
            except json.JSONDecodeError:
                arguments[key] = raw
        out.append(_call(name, arguments))
    return out


def parse_tool_calls(text: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The tool calls in a reply, in order, as ``{"type": "function", "function": {"name",
    "arguments"}}`` (arguments as parsed JSON), and an error message for each part that looks
    like a call but cannot be read (an unclosed block, bad JSON, a call without a name). A reply
    with neither is a final answer."""
    calls: list[dict[str, Any]] = []
    errors: list[str] = []
    for body in _BLOCK.findall(text):
        body = body.strip()
        if body.startswith("<function"):
            parsed: list[Any] = _from_xml(body)
        else:
            try:
                value = json.loads(body)
            except json.JSONDecodeError as exc:
                errors.append(f"the <tool_call> block is not valid JSON ({exc.msg}): {body[:80]!r}")
                continue
            items = value if isinstance(value, list) else [value]
            parsed = [_from_json(item) for item in items] or ["an empty list of tool calls"]
        for item in parsed:
            (errors if isinstance(item, str) else calls).append(item)
    rest = _BLOCK.sub("", text)
    if "<tool_call>" in rest:
        errors.append("a <tool_call> block is not closed with </tool_call>")
    return calls, errors


@dataclass(frozen=True)
class ToolCallFormat:
    """How tools are offered in the system turn (``tools_prompt``) and how results are shown
    back (``observation_messages``) in one model family's format."""

    name: str
    observation_role: str  # "tool", or "user" with <tool_response> blocks

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        if self.name == "qwen3_5":
            return tools_block(tools)
        listed = (
            json.dumps(tools, ensure_ascii=False)
            if self.name == "smollm2"
            else "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        )
        example = (
            '<tool_call>[{"name": "tool_name", "arguments": {"arg": "value"}}]</tool_call>'
            if self.name == "smollm2"
            else '<tool_call>\n{"name": "tool_name", "arguments": {"arg": "value"}}\n</tool_call>'
        )
        return (
            "You can call these tools, described as JSON schemas inside <tools></tools>:\n"
            f"<tools>{listed if self.name == 'smollm2' else chr(10) + listed + chr(10)}</tools>\n\n"
            f"To call a tool, write the call in this form:\n{example}\n"
            "The result comes back in the next message. When you have the answer, reply without a tool call."
        )

    def observation_messages(self, results: list[str]) -> list[dict[str, str]]:
        """The messages that show ``results`` (one per call, in order) to the model."""
        if self.observation_role == "tool":
            return [{"role": "tool", "content": r} for r in results]
        blocks = "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)
        return [{"role": "user", "content": blocks}]


TOOL_FORMATS = {
    "hermes": ToolCallFormat("hermes", observation_role="user"),
    "smollm2": ToolCallFormat("smollm2", observation_role="tool"),
    "qwen3_5": ToolCallFormat("qwen3_5", observation_role="user"),
}


def get_format(name: str | ToolCallFormat) -> ToolCallFormat:
    """A format by name (``TOOL_FORMATS``); an unknown name lists the known ones."""
    if isinstance(name, ToolCallFormat):
        return name
    if name not in TOOL_FORMATS:
        raise UserError(f"unknown tool-call format {name!r}; known: {', '.join(TOOL_FORMATS)}")
    return TOOL_FORMATS[name]
