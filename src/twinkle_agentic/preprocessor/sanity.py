"""``MessageSanityFilter``: drops a conversation whose structure a chat template cannot render or
a trainer should not learn from."""

from collections.abc import Mapping
from typing import Any

from twinkle_agentic.preprocessor.step import FilterStep, Rows
from twinkle_agentic.preprocessor.text import content_text, messages_of

ROLES = ("system", "user", "assistant", "tool")


class MessageSanityFilter(FilterStep):
    """Drops a row whose messages break one of these rules (its ``drop_reason`` names which):

    - every message has a known role (``ROLES``), and every content is text or a list of parts;
    - at least ``min_turns`` messages besides the system prompt, none longer than
      ``max_msg_chars`` characters;
    - with ``check_role_order``: the system prompt comes first and only once, the conversation
      opens with a user turn, a user turn is never followed by another, and a tool result follows
      an assistant turn that called tools or another tool result;
    - with ``check_tool_matching``: a tool result's ``tool_call_id`` names a call of the assistant
      turn it answers.

    With ``trim_to_assistant`` a row is first cut after its last assistant turn that has text or
    tool calls (trailing user or tool turns teach nothing), and the cut row is kept."""

    def __init__(
        self,
        min_turns: int = 2,
        max_msg_chars: int = 80000,
        check_role_order: bool = True,
        check_tool_matching: bool = True,
        trim_to_assistant: bool = True,
    ) -> None:
        self.min_turns, self.max_msg_chars = min_turns, max_msg_chars
        self.check_role_order, self.check_tool_matching = check_role_order, check_tool_matching
        self.trim_to_assistant = trim_to_assistant

    def __call__(self, rows: Any) -> tuple[Rows, Rows]:  # type: ignore[override]
        rows = self.map_col_to_row(rows)
        if self.trim_to_assistant:
            rows = [self._trimmed(row) for row in rows]
        return super().__call__(rows)

    @staticmethod
    def _trimmed(row: dict[str, Any]) -> dict[str, Any]:
        messages = messages_of(row)
        for end in range(len(messages), 0, -1):
            last = messages[end - 1]
            if last.get("role") == "assistant" and (
                content_text(last.get("content")).strip() or last.get("tool_calls")
            ):
                return {**row, "messages": list(messages[:end])} if end < len(messages) else row
        return row

    def reason(self, row: Mapping[str, Any]) -> str | None:
        messages = messages_of(row)
        if not isinstance(row.get("messages"), list) or len(messages) != len(row["messages"]):
            return "messages_not_a_list_of_dicts"
        for message in messages:
            if message.get("role") not in ROLES:
                return "unknown_role"
            content = message.get("content")
            if content is not None and not isinstance(content, str | list):
                return "bad_content"
            if len(content_text(content)) > self.max_msg_chars:
                return "message_too_long"
        turns = [m for m in messages if m.get("role") != "system"]
        if len(turns) < self.min_turns:
            return "too_few_turns"
        if self.check_role_order and (why := _order_problem(messages)):
            return why
        if self.check_tool_matching and (why := _tool_problem(messages)):
            return why
        return None


def _order_problem(messages: list[Mapping[str, Any]]) -> str | None:
    roles = [m.get("role") for m in messages]
    if "system" in roles[1:]:
        return "system_not_first"
    turns = [m for m in messages if m.get("role") != "system"]
    if not turns or turns[0].get("role") != "user":
        return "does_not_open_with_user"
    for before, after in zip(turns, turns[1:], strict=False):
        if before.get("role") == after.get("role") == "user":
            return "two_user_turns_in_a_row"
        if after.get("role") == "tool" and not (
            before.get("role") == "tool" or (before.get("role") == "assistant" and before.get("tool_calls"))
        ):
            return "tool_result_without_call"
    return None


def _tool_problem(messages: list[Mapping[str, Any]]) -> str | None:
    calls: set[str] = set()
    for message in messages:
        role = message.get("role")
        if role == "assistant":
            calls = {
                str(c.get("id"))
                for c in message.get("tool_calls") or []
                if isinstance(c, Mapping) and c.get("id")
            }
        elif role == "tool":
            wanted = message.get("tool_call_id")
            if wanted is not None and calls and str(wanted) not in calls:
                return "tool_result_names_no_call"
        elif role == "user":
            calls = set()
    return None
