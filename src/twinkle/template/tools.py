"""Tool calls written the way Qwen3.5's chat template writes them, as plain chat messages.

Public names: ``qwen3_5_tool_messages``, ``tools_block``, ``tool_call_text``.

A conversation with tools carries them as OpenAI function schemas in a ``tools`` key of one of
its messages (``ToolCallProcessor`` puts them on the first), assistant turns may carry
``tool_calls`` and tool results come as ``tool`` messages. Both may be given as lists or as
JSON text (the form ``ToolCallProcessor`` stores, since Arrow needs one column type for every
row). ``qwen3_5_tool_messages`` rewrites such a conversation into system/user/assistant messages
whose text is Qwen3.5's layout, so that ``Qwen3_5Template`` renders and masks it like any other
chat:

- the system turn starts with the tool list and the call-format instructions, followed by the
  system message's own text (when there is one);
- an assistant turn's calls follow its text as ``<tool_call>`` blocks holding
  ``<function=NAME>`` and one ``<parameter=KEY>`` per argument; they are part of the reply and
  so are supervised;
- a run of ``tool`` messages becomes one user turn of ``<tool_response>`` blocks (never
  supervised).
"""

import json
from typing import Any

from twinkle.utils.errors import UserError

# Qwen3.5's system-prompt text around the tool list; the model was trained on these exact words.
_TOOLS_HEAD = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
_TOOLS_TAIL = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\n"
    "multiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must be "
    "nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the function "
    "call, but NOT after\n"
    "- If there is no function call available, answer the question like normal with your current "
    "knowledge and do not tell the user about function calls\n</IMPORTANT>"
)


def _to_json(value: Any) -> str:
    """The chat template's ``tojson``: key order kept, non-ASCII text kept as is."""
    return json.dumps(value, ensure_ascii=False)


def _decode(value: Any, what: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value) if value.strip() else None
        except json.JSONDecodeError as exc:
            raise UserError(f"{what} is not valid JSON ({exc.msg}): {value[:80]!r}") from None
    return value


def tools_block(tools: list[dict[str, Any]]) -> str:
    """The tool list and call-format instructions that open the system turn."""
    return _TOOLS_HEAD + "".join("\n" + _to_json(tool) for tool in tools) + _TOOLS_TAIL


def _parameter(key: str, value: Any) -> str:
    # Objects and arrays as JSON, anything else as its text (the template's ``| string``).
    text = _to_json(value) if isinstance(value, dict | list | tuple) else str(value)
    return f"<parameter={key}>\n{text}\n</parameter>\n"


def tool_call_text(calls: Any) -> str:
    """``tool_calls`` (OpenAI ``{function: {name, arguments}}`` or flat ``{name, arguments}``;
    arguments a dict or JSON text) -> the ``<tool_call>`` blocks, one per line."""
    blocks = []
    for call in _decode(calls, "tool_calls") or []:
        function = (call.get("function") or call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise UserError(f"a tool call needs a function name, got {call!r}")
        arguments = _decode(function.get("arguments"), f"the arguments of tool call {function['name']!r}")
        if not isinstance(arguments, dict | None):
            raise UserError(f"the arguments of tool call {function['name']!r} must be a JSON object")
        params = "".join(_parameter(k, v) for k, v in (arguments or {}).items())
        blocks.append(f"<tool_call>\n<function={function['name']}>\n{params}</function>\n</tool_call>")
    return "\n".join(blocks)


def _has_tool_content(messages: list[dict[str, Any]]) -> bool:
    return any(m.get("tools") or m.get("tool_calls") or m["role"] == "tool" for m in messages)


def qwen3_5_tool_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rewrite a conversation with tools into Qwen3.5's text layout (see the module docstring);
    a conversation without tools, tool calls or tool results is returned as it is."""
    if not _has_tool_content(messages):
        return messages
    carriers = [m for m in messages if m.get("tools")]
    if len(carriers) > 1:
        raise UserError("a conversation lists its tools once; found 'tools' on several messages")
    tools = _decode(carriers[0]["tools"], "tools") if carriers else None
    out: list[dict[str, str]] = []
    if tools:
        system = messages[0]["content"].strip() if messages[0]["role"] == "system" else ""
        out.append({"role": "system", "content": tools_block(tools) + (f"\n\n{system}" if system else "")})
    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content") or ""
        if role == "system" and tools:
            continue  # already written after the tool list
        if role == "assistant" and m.get("tool_calls"):
            text = content.strip()
            out.append(
                {
                    "role": "assistant",
                    "content": text + ("\n\n" if text else "") + tool_call_text(m["tool_calls"]),
                }
            )
        elif role == "tool":
            block = f"<tool_response>\n{content.strip()}\n</tool_response>"
            if i > 0 and messages[i - 1]["role"] == "tool":
                out[-1]["content"] += "\n" + block  # consecutive results share one user turn
            else:
                out.append({"role": "user", "content": block})
        else:
            out.append({"role": role, "content": content})
    return out
