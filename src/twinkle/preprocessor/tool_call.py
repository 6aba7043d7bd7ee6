"""``ToolCallProcessor``: agent conversations in OpenAI's shape (function ``tools``, assistant
``tool_calls``, ``tool`` results) -> messages a template renders with their tools."""

import json
from typing import Any

from twinkle.preprocessor.base import SPOKEN_ROLES, BadRow, Preprocessor

TOOL_ROLES = ("system", "user", "assistant", "tool")


def _without_nulls(value: Any) -> Any:
    """Drop null-valued keys at every depth: rows loaded from JSONL share one Arrow schema, which
    pads each object with the other rows' keys set to null (a tool schema would grow fields)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _json_value(value: Any, what: str, field: str, index: int | None) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value) if value.strip() else None
        except json.JSONDecodeError as exc:
            raise BadRow(index, field, f": {what} is not valid JSON ({exc.msg})") from None
    return _without_nulls(value)


class ToolCallProcessor(Preprocessor):
    """Validate and normalise a row ``{'messages': [...], 'tools': [...]}``.

    - ``tools``: OpenAI function schemas (``{'type': 'function', 'function': {'name', ...}}``),
      a list or its JSON text; optional.
    - assistant messages may carry ``tool_calls`` (``{'function': {'name', 'arguments'}}``, or
      flat ``{'name', 'arguments'}``; ``arguments`` a dict or JSON text) and then may have no
      content; a ``tool`` message holds one call's result and follows the calls (ids are dropped:
      Qwen's template pairs results with calls by order).

    Every output message has the same four text fields, ``role``, ``content``, ``tool_calls``
    (JSON text, empty when none) and ``tools`` (the row's tools as JSON text on the first
    message, empty elsewhere), because Arrow stores each column with one type for all rows.
    ``Qwen3_5Template`` renders them as Qwen3.5's chat template does (``twinkle.template.tools``).
    """

    def preprocess(self, row: dict[str, Any], index: int | None = None) -> dict[str, Any]:
        messages = row.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRow(index, "messages", " has no 'messages' list")
        tools = _json_value(row.get("tools"), "'tools'", "tools", index) or []
        if not isinstance(tools, list) or not all(_tool_name(t) for t in tools):
            raise BadRow(
                index, "tools", ": 'tools' must be a list of function schemas, each with a function name"
            )
        out = [self._message(m, i, messages, index) for i, m in enumerate(messages)]
        if not any(m["role"] == "assistant" for m in out[1:]):
            raise BadRow(
                index,
                "messages",
                ": 'messages' has no assistant turn after the first message, so nothing is learnt; "
                "add the reply to train on",
            )
        out[0]["tools"] = json.dumps(tools, ensure_ascii=False) if tools else ""
        return {"messages": out}

    def _message(self, m: Any, i: int, messages: list, index: int | None) -> dict[str, str]:
        field = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in TOOL_ROLES:
            role = m.get("role") if isinstance(m, dict) else None
            raise BadRow(
                index,
                f"{field}.role",
                f": {field}.role is {role!r}; each message needs a role in {TOOL_ROLES}",
            )
        role, content = m["role"], m.get("content")
        calls = _json_value(m.get("tool_calls"), f"{field}.tool_calls", f"{field}.tool_calls", index) or []
        if calls and role != "assistant":
            raise BadRow(
                index,
                f"{field}.tool_calls",
                f": {field} ({role}) has tool_calls; only assistant messages call tools",
            )
        if role == "system" and i != 0:
            raise BadRow(
                index, f"{field}.role", f": only the first message may be a system message ({field})"
            )
        previous = messages[i - 1] if i > 0 and isinstance(messages[i - 1], dict) else {}
        if role == "tool" and not (previous.get("role") == "tool" or previous.get("tool_calls")):
            raise BadRow(
                index, f"{field}.role", f": tool {field} must follow an assistant message with tool_calls"
            )
        if not isinstance(content, str) and not (content is None and calls):
            raise BadRow(
                index, f"{field}.content", f": {field}.content ({role}) needs a text content, got {content!r}"
            )
        if role in SPOKEN_ROLES and not calls and not content.strip():
            raise BadRow(index, f"{field}.content", f": {field}.content ({role}) is empty")
        return {
            "role": role,
            "content": content or "",
            "tool_calls": _calls_json(calls, i, index),
            "tools": "",
        }


def _tool_name(tool: Any) -> str | None:
    if not isinstance(tool, dict):
        return None
    function = tool.get("function", tool)
    return (
        function.get("name") if isinstance(function, dict) and isinstance(function.get("name"), str) else None
    )


def _calls_json(calls: Any, i: int, index: int | None) -> str:
    field = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise BadRow(index, field, f": {field} must be a list, got {type(calls).__name__}")
    normal = []
    for call in calls:
        function = (call.get("function") or call) if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise BadRow(index, field, f": {field}: each tool call needs a function name, got {call!r}")
        arguments = _json_value(function.get("arguments"), f"the arguments of {name!r}", field, index)
        if not isinstance(arguments, dict | None):
            raise BadRow(index, field, f": {field}: the arguments of {name!r} must be a JSON object")
        normal.append({"type": "function", "function": {"name": name, "arguments": arguments or {}}})
    return json.dumps(normal, ensure_ascii=False) if normal else ""
