"""``DeepseekV4Template``: DeepSeek-V4's chat format, written out here (the model ships its format
as code, not as a tokenizer chat template), in chat or thinking mode, with DSML tool calls.

The layout of one conversation::

    <｜begin▁of▁sentence｜>SYSTEM TEXT<｜User｜>QUESTION<｜Assistant｜>OPENER REPLY<｜end▁of▁sentence｜>...

- the system text follows the begin-of-sentence marker as it is, with the tool list after it;
- every user turn starts with ``<｜User｜>``; consecutive user and tool messages make one user turn,
  their texts joined by a blank line, a tool result written as ``<tool_result>...</tool_result>``;
- a user turn followed by the assistant (or ending the conversation) is closed by
  ``<｜Assistant｜>`` and an opener: ``</think>`` in chat mode, ``<think>`` in thinking mode;
- the reply is ``REASONING</think>`` (thinking mode), the answer, its tool calls, and the
  end-of-sentence marker.

In thinking mode the reasoning of replies before the last user turn is dropped and their opener is
``</think>``, as the model sees its past turns at inference; a conversation with tools keeps every
turn's reasoning. The opener belongs to the prompt; the reply, end marker included, is supervised.
"""

import copy
import json
from typing import Any

from twinkle.template.base import Segment, Template
from twinkle.utils.errors import UserError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
DSML = "｜DSML｜"
REASONING_EFFORTS = ("high", "max")

# Text the model was trained on, word for word: the preamble of reasoning effort 'max' ('high'
# writes nothing) and the tool instructions written after the system text.
EFFORT_MAX_PREAMBLE = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\nExplicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
TOOLS_INSTRUCTIONS = (
    "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke tools by "
    'writing a\n"<{d}tool_calls>" block like the following:\n\n<{d}tool_calls>\n<{d}invoke name="$TOOL_NAME">\n'
    '<{d}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{d}parameter>\n...\n'
    '</{d}invoke>\n<{d}invoke name="$TOOL_NAME2">\n...\n</{d}invoke>\n</{d}tool_calls>\n\n'
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    'booleans, arrays,\nobjects), pass the value in JSON format and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by {o}), you MUST output your complete reasoning inside\n"
    "{o}...{c} BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after {c} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n{schemas}\n\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _from_json(value: Any, what: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value) if value.strip() else None
    except json.JSONDecodeError as exc:
        raise UserError(f"{what} is not valid JSON ({exc.msg}): {value[:80]!r}") from None


def tools_text(tools: Any) -> str:
    """The tool instructions with one JSON schema per line (OpenAI ``{type, function}`` entries
    or the function schemas themselves, as a list or JSON text)."""
    schemas = [t.get("function", t) if isinstance(t, dict) else t for t in _from_json(tools, "tools") or []]
    return TOOLS_INSTRUCTIONS.format(
        d=DSML, o=THINK_OPEN, c=THINK_CLOSE, schemas="\n".join(_json(s) for s in schemas)
    )


def tool_calls_text(calls: Any) -> str:
    """An assistant's ``tool_calls`` (OpenAI ``{function: {name, arguments}}`` or flat ``{name,
    arguments}``; arguments a dict or JSON text) as one DSML ``tool_calls`` block."""
    invokes = []
    for call in _from_json(calls, "tool_calls") or []:
        function = (call.get("function") or call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise UserError(f"a tool call needs a function name, got {call!r}")
        name = function["name"]
        arguments = _from_json(function.get("arguments"), f"the arguments of tool call {name!r}") or {}
        if not isinstance(arguments, dict):
            raise UserError(f"the arguments of tool call {name!r} must be a JSON object")
        params = "\n".join(
            f'<{DSML}parameter name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
            f"{value if isinstance(value, str) else _json(value)}</{DSML}parameter>"
            for key, value in arguments.items()
        )
        invokes.append(f'<{DSML}invoke name="{name}">\n{params}\n</{DSML}invoke>')
    if not invokes:
        return ""
    return f"<{DSML}tool_calls>\n" + "\n".join(invokes) + f"\n</{DSML}tool_calls>"


def reasoning_and_answer(message: dict[str, Any]) -> tuple[str, str]:
    """An assistant turn's reasoning (``reasoning_content``, ``reasoning``, or the text before
    ``</think>`` in its content) and its answer."""
    content = message.get("content") or ""
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning is None and THINK_CLOSE in content:
        head, content = content.split(THINK_CLOSE, 1)
        reasoning = head.split(THINK_OPEN)[-1].strip("\n")
        content = content.lstrip("\n")
    return reasoning or "", content


def _turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive user and tool messages merged into one user turn of text blocks."""
    turns: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise UserError(
                f"DeepseekV4Template: unknown role {role!r}; roles are system, user, assistant, tool"
            )
        text = m.get("content") or ""
        if role == "tool":
            text = f"<tool_result>{text}</tool_result>"
        if role in ("user", "tool"):
            if turns and turns[-1]["role"] == "user":
                turns[-1]["blocks"].append(text)
            else:
                turns.append({"role": "user", "blocks": [text]})
        else:
            turns.append({k: v for k, v in m.items() if k != "tools"})
    return turns


def deepseek_v4_segments(
    messages: list[dict[str, Any]], thinking: bool, reasoning_effort: str | None = None
) -> list[Segment]:
    """A conversation in DeepSeek-V4's format (see the module docstring): ``(text, supervised)``
    pieces, the assistant replies supervised."""
    listed = [tools for m in messages if (tools := _from_json(m.get("tools"), "tools"))]
    if len(listed) > 1:
        raise UserError("a conversation lists its tools once; found 'tools' on several messages")
    turns = _turns(messages)
    if listed:  # the tool list follows the system text; a conversation without one gets an empty one
        if not any(t["role"] == "system" for t in turns):
            turns.insert(0, {"role": "system", "content": ""})
        next(t for t in turns if t["role"] == "system")["tools"] = listed[0]
    keep_reasoning = bool(listed)  # DeepSeek-V4 keeps every turn's reasoning when tools are offered
    last_user = max((i for i, t in enumerate(turns) if t["role"] == "user"), default=-1)

    head = BOS + (EFFORT_MAX_PREAMBLE if thinking and reasoning_effort == "max" else "")
    pieces: list[Segment] = [(head, False)]
    for i, turn in enumerate(turns):
        role = turn["role"]
        if role == "system":
            text = turn.get("content") or ""
            pieces.append((text + ("\n\n" + tools_text(turn["tools"]) if turn.get("tools") else ""), False))
        elif role == "user":
            text = USER + "\n\n".join(turn["blocks"])
            if i + 1 == len(turns) or turns[i + 1]["role"] == "assistant":
                opens_thinking = thinking and (keep_reasoning or i >= last_user)
                text += ASSISTANT + (THINK_OPEN if opens_thinking else THINK_CLOSE)
            pieces.append((text, False))
        else:
            reasoning, answer = reasoning_and_answer(turn)
            reply = ""
            if thinking and (keep_reasoning or i > last_user):
                reply = reasoning + THINK_CLOSE
            calls = tool_calls_text(turn.get("tool_calls"))
            reply += answer + ("\n\n" + calls if calls else "") + EOS
            pieces.append((reply, True))
    return [p for p in pieces if p[0]]


class DeepseekV4Template(Template):
    """DeepSeek-V4's chat format (see the module), rendered here so that every turn is written the
    way the model reads and writes it at inference.

    - ``enable_thinking``: ``True`` or unset (DeepSeek-V4's default) is thinking mode: the prompt
      ends at ``<｜Assistant｜><think>`` and the reply is the reasoning (``reasoning_content``, or
      the text before ``</think>`` in the content; empty when there is none), ``</think>``, the
      answer and ``<｜end▁of▁sentence｜>``. ``False`` is chat mode: the prompt ends at
      ``<｜Assistant｜></think>`` and the reply is the answer and the end marker.
    - ``reasoning_effort``: ``'high'`` or ``'max'`` (thinking mode only); ``'max'`` writes
      DeepSeek's maximum-effort preamble at the start of the conversation, ``'high'`` writes
      nothing. ``encode(..., reasoning_effort=...)`` sets it for one call.
    - Tools: OpenAI function schemas in a ``tools`` key of one message (as ``ToolCallProcessor``
      writes them), ``tool_calls`` on assistant turns, results as ``tool`` messages, all written
      in DeepSeek's DSML markup.
    - ``use_chat_template=True`` renders with the tokenizer's own chat template instead, and
      ``False`` trains on plain text (see ``Template``)."""

    MARKERS = (BOS, EOS, USER, ASSISTANT)

    def __init__(
        self,
        model_id: Any = None,
        use_chat_template: bool | None = None,
        max_length: int = 1024,
        truncation_strategy: str = "right",
        default_system: str | None = None,
        enable_thinking: bool | None = None,
        reasoning_effort: str | None = None,
    ):
        self.reasoning_effort = reasoning_effort
        super().__init__(
            model_id,
            use_chat_template=use_chat_template,
            max_length=max_length,
            truncation_strategy=truncation_strategy,
            default_system=default_system,
            enable_thinking=enable_thinking,
        )

    @property
    def thinking(self) -> bool:
        return self.enable_thinking is not False

    @property
    def renders_with_tokenizer(self) -> bool:
        return self.use_chat_template is True

    def _check_options(self) -> None:
        if self.reasoning_effort is not None:
            if self.reasoning_effort not in REASONING_EFFORTS:
                raise UserError(
                    f"reasoning_effort={self.reasoning_effort!r} is not one of {', '.join(REASONING_EFFORTS)} (or None)"
                )
            if not self.thinking or self.use_chat_template is not None:
                raise UserError(
                    f"reasoning_effort={self.reasoning_effort!r} needs DeepSeek-V4's thinking mode "
                    "(enable_thinking unset or True, use_chat_template unset)"
                )
        super()._check_options()
        if self.use_chat_template is not None:
            return
        vocab = self.tokenizer.get_vocab()
        missing = [t for t in self.MARKERS if t not in vocab]
        if missing:
            raise UserError(
                f"DeepseekV4Template writes DeepSeek-V4's format, but the tokenizer of {self.model_id or 'this model'} "
                f"has no {', '.join(missing)} token; use the model's own tokenizer, or Template"
            )

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "reasoning_effort": self.reasoning_effort}

    def segments(self, messages: list[dict[str, Any]]) -> list[Segment]:
        if self.use_chat_template is not None:
            return super().segments(messages)
        return deepseek_v4_segments(messages, self.thinking, self.reasoning_effort)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        if self.use_chat_template is not None:
            return super().render(messages, add_generation_prompt)
        last = messages[-1]["role"] if messages else None
        if add_generation_prompt and last not in ("user", "tool"):
            raise UserError(
                f"DeepseekV4Template opens the assistant's turn after a user or tool turn; this prompt ends "
                f"with {'no message' if last is None else f'a turn of role {last!r}'}"
            )
        return "".join(text for text, _ in self.segments(messages))

    def encode(
        self,
        trajectory: Any,
        add_generation_prompt: bool = False,
        index: int | None = None,
        reasoning_effort: str | None = None,
    ) -> dict[str, Any] | None:
        """``Template.encode``; ``reasoning_effort`` (``'high'``, ``'max'``) for this call only."""
        if reasoning_effort is None or reasoning_effort == self.reasoning_effort:
            return super().encode(trajectory, add_generation_prompt, index)
        other = copy.copy(self)
        other.reasoning_effort = reasoning_effort
        other._check_options()
        return Template.encode(other, trajectory, add_generation_prompt, index)
