"""A sampler's input rows -> prompt tokens, and a sampled sequence -> a training row."""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from twinkle.sampler.vision_prefill import Vision, vision_of
from twinkle.template import Template
from twinkle.template.rows import (
    ENCODED_KEYS,
    IGNORE_INDEX,
    as_ids,
    concat_reply,
    feature_of,
    without_empty_reply,
)
from twinkle.utils.errors import UserError

VISION_KEYS = ("pixel_values", "image_grid_thw", "image_position_ids", "image_counts")


@dataclass
class Prompt:
    """One row's prompt tokens, its messages (when given as chat) and its other keys
    (``user_data``, an answer to score against...), carried over to the training row."""

    ids: list[int]
    messages: list[dict[str, Any]] | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    labels: list[int] | None = None  # a scored row's own labels (``max_tokens=0``)
    vision: Vision | None = None  # its images' pixel_values and image_grid_thw (Gemma 4: image_position_ids)

    def row(self, labels: list[int] | None = None) -> dict[str, Any]:
        """The prompt as an encoded row: its other keys, its messages, its images, its tokens
        and ``labels`` (all ``-100`` when None)."""
        row = dict(self.extras)
        if self.messages is not None:
            row["messages"] = list(self.messages)
        if self.vision is not None:
            row.update(self.vision)
        row.update(feature_of(list(self.ids), labels or [IGNORE_INDEX] * len(self.ids)))
        return row


def _has_images(message: Any) -> bool:
    """``Message.images``, or an image among upstream's content parts."""
    if not isinstance(message, Mapping):
        return False
    content = message.get("content")
    parts = content if isinstance(content, list | tuple) else ()
    return bool(message.get("images")) or any(
        isinstance(p, Mapping) and p.get("type") == "image" for p in parts
    )


def prompts_of(inputs: Any, template: Callable[[], Template], scoring: bool = False) -> list[Prompt]:
    """``inputs``: a row or a list of rows, each ``{'messages': [...]}`` or ``{'input_ids': [...]}``
    (an empty list is allowed: under FSDP a rank's share of the prompts may be empty). A row's
    images: its messages' (``Message.images``, encoded by a vision-language template) or an
    encoded row's ``pixel_values`` and ``image_grid_thw`` (a Gemma row: ``pixel_values`` and,
    on Gemma 4, ``image_position_ids``).
    ``scoring`` (``max_tokens=0``): messages are the whole conversation to score, encoded with
    its labels, rather than a prompt that the generation prompt ends."""
    rows = [inputs] if isinstance(inputs, Mapping) else inputs
    if isinstance(rows, str | bytes) or not isinstance(rows, Sequence):
        raise UserError(
            f"sample(inputs=...) got {type(inputs).__name__}; pass a row or a list of rows "
            "({'messages': [...]} or {'input_ids': [...]})"
        )
    return [_prompt(i, row, template, scoring) for i, row in enumerate(rows)]


def _prompt(i: int, row: Any, template: Callable[[], Template], scoring: bool) -> Prompt:
    if not isinstance(row, Mapping) or ("input_ids" not in row and "messages" not in row):
        keys = sorted(row) if isinstance(row, Mapping) else type(row).__name__
        raise UserError(
            f"input row {i} has neither 'messages' nor 'input_ids' ({keys}); pass chat or token rows"
        )
    extras = {k: v for k, v in row.items() if k not in ENCODED_KEYS and k != "messages"}
    messages = list(row["messages"]) if row.get("messages") is not None else None
    labels, vision = None, None
    if "input_ids" in row:
        if len(row["input_ids"]) and isinstance(row["input_ids"][0], list):
            raise UserError(f"input row {i}: input_ids must be one list of token ids, not a batch")
        ids = as_ids(row["input_ids"])
        labels = as_ids(row["labels"]) if scoring and row.get("labels") is not None else None
        vision = vision_of(row)
    elif not messages:
        raise UserError(f"input row {i} has no messages")
    elif scoring:
        encoded = template().encode(messages, index=i)
        if encoded is None:
            raise UserError(
                f"input row {i} is longer than the template's max_length (truncation_strategy='delete')"
            )
        ids, labels, vision = encoded["input_ids"], encoded["labels"], vision_of(encoded)
    else:
        messages = without_empty_reply(messages)
        if not messages or messages[-1].get("role") == "assistant":
            raise UserError(
                f"input row {i} ends with an assistant message; a prompt ends with the user's turn "
                "(keep a reference answer in another key, e.g. user_data; or score it with max_tokens=0)"
            )
        chosen = template()
        if getattr(chosen, "encodes_images", False):  # a vision-language template
            ids, _, images = chosen.tokens(messages, add_generation_prompt=True, index=i)
            vision = vision_of(images)
        else:
            held = [k for k, m in enumerate(messages) if _has_images(m)]
            if held:  # the text template would prompt with the text alone, the pictures dropped
                raise UserError(
                    f"input row {i}: messages[{held[0]}] has images, but {type(chosen).__name__} reads text only; "
                    "sample a vision-language model with its template (set_template('Qwen3_5Template', model_id=...) "
                    "on a Qwen3.5 checkpoint with an image processor)"
                )
            ids = chosen.prompt_ids(messages)
    if not ids:
        raise UserError(f"input row {i} has an empty prompt; give at least one token or message")
    extras = {k: v for k, v in extras.items() if k not in VISION_KEYS}  # carried as ``vision``
    return Prompt(list(ids), messages, extras, labels, vision)


def new_input_feature(prompt: Prompt, tokens: list[int], decoded: str) -> dict[str, Any]:
    """Prompt plus completion as a training row: labels -100 on the prompt, the tokens on the
    completion; the prompt's messages plus the reply as an assistant turn when the prompt came
    with messages (a reward reads them). A scored prompt (no tokens) keeps its own labels."""
    if not tokens:
        return prompt.row(prompt.labels)
    return concat_reply(prompt.row(), tokens, decoded)
