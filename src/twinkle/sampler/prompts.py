"""A sampler's input rows -> prompt tokens, and a sampled sequence -> a training row."""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from twinkle.template import Template
from twinkle.template.base import IGNORE_INDEX
from twinkle.utils.errors import UserError

ENCODED_KEYS = ("input_ids", "labels", "attention_mask", "position_ids", "length")


@dataclass
class Prompt:
    """One row's prompt tokens, its messages (when given as chat) and its other keys
    (``user_data``, an answer to score against...), carried over to the training row."""

    ids: list[int]
    messages: list[dict[str, Any]] | None = None
    extras: dict[str, Any] = field(default_factory=dict)


def prompts_of(inputs: Any, template: Callable[[], Template], tokenizer: Any) -> list[Prompt]:
    """``inputs``: a row or a list of rows, each ``{'messages': [...]}`` or ``{'input_ids': [...]}``
    (an empty list is allowed: under FSDP a rank's share of the prompts may be empty)."""
    rows = [inputs] if isinstance(inputs, Mapping) else inputs
    if isinstance(rows, str | bytes) or not isinstance(rows, Sequence):
        raise UserError(
            f"sample(inputs=...) got {type(inputs).__name__}; pass a row or a list of rows "
            "({'messages': [...]} or {'input_ids': [...]})"
        )
    return [_prompt(i, row, template, tokenizer) for i, row in enumerate(rows)]


def _prompt(i: int, row: Any, template: Callable[[], Template], tokenizer: Any) -> Prompt:
    if not isinstance(row, Mapping) or ("input_ids" not in row and "messages" not in row):
        keys = sorted(row) if isinstance(row, Mapping) else type(row).__name__
        raise UserError(
            f"input row {i} has neither 'messages' nor 'input_ids' ({keys}); pass chat or token rows"
        )
    extras = {k: v for k, v in row.items() if k not in ENCODED_KEYS and k != "messages"}
    messages = list(row["messages"]) if "messages" in row else None
    if "input_ids" in row:
        ids = row["input_ids"]
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        if ids and isinstance(ids[0], list):
            raise UserError(f"input row {i}: input_ids must be one list of token ids, not a batch")
    else:
        ids = _render(i, messages, template(), tokenizer)
    if not ids:
        raise UserError(f"input row {i} has an empty prompt; give at least one token or message")
    return Prompt([int(t) for t in ids], messages, extras)


def _render(i: int, messages: list[dict[str, Any]], template: Template, tokenizer: Any) -> list[int]:
    """The prompt as the template renders it, the generation prompt appended."""
    if not messages:
        raise UserError(f"input row {i} has no messages")
    if messages[-1].get("role") == "assistant":
        raise UserError(
            f"input row {i} ends with an assistant message; a prompt ends with the user's turn "
            "(keep a reference answer in another key, e.g. user_data)"
        )
    if template.use_chat_template is False:  # plain text: the message is the prompt
        return tokenizer(messages[0]["content"], add_special_tokens=True)["input_ids"]
    text = template.render(template.with_default_system(messages), add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def new_input_feature(prompt: Prompt, tokens: list[int], decoded: str) -> dict[str, Any]:
    """Prompt plus completion as a training row: labels -100 on the prompt, the tokens on the
    completion; the prompt's messages plus the reply when the prompt came as messages."""
    ids = [*prompt.ids, *tokens]
    row = dict(prompt.extras)
    row.update(
        input_ids=ids,
        labels=[IGNORE_INDEX] * len(prompt.ids) + list(tokens),
        attention_mask=[1] * len(ids),
        position_ids=list(range(len(ids))),
        length=len(ids),
    )
    if prompt.messages is not None:
        row["messages"] = [*prompt.messages, {"role": "assistant", "content": decoded}]
    return row
