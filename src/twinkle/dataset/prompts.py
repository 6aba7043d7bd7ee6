"""Prompt-only encoding, ``Dataset.encode(add_generation_prompt=True)``: each row's ``messages``
(system and user turns) rendered with the template's generation prompt, for a sampler to
complete (RL). The row keeps its other columns (``messages``, ``user_data`` ...), which the
sampler carries over to the sampled rows a reward reads.

The prompt has no supervised token (every label is -100). A row whose ``messages`` end with an
empty assistant turn (upstream's prompt rows do) is the prompt before it; one that ends with an
assistant reply is a bad row, since the sampler would be asked to continue a finished turn."""

import json
from typing import Any

import datasets
import numpy as np
from datasets.fingerprint import generate_random_fingerprint

from twinkle.dataset.ops import ROW_COLUMN, cap_num_proc
from twinkle.preprocessor.base import BadRow
from twinkle.template import Template
from twinkle.template.base import IGNORE_INDEX
from twinkle.utils.errors import UserError
from twinkle.utils.values import kind_of

BAD_COLUMN = "__twinkle_bad__"
PROMPT_COLUMNS = ("input_ids", "labels", "attention_mask", "position_ids", "length")
_KEPT_BAD = 20


def _prompt_messages(messages: Any, index: int) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise BadRow(index, "messages", f": 'messages' is {kind_of(messages)}, not a list of messages")
    last = messages[-1]
    if isinstance(last, dict) and last.get("role") == "assistant" and not (last.get("content") or "").strip():
        messages = messages[:-1]
    for i, m in enumerate(messages):
        for key in ("role", "content"):
            value = m.get(key) if isinstance(m, dict) else None
            if not isinstance(value, str):
                raise BadRow(
                    index, f"messages[{i}].{key}", f": messages[{i}].{key} is {kind_of(value)}, not text"
                )
    if not messages or messages[-1]["role"] == "assistant":
        raise BadRow(
            index,
            "messages",
            ": 'messages' ends with an assistant reply, but a prompt ends with the user's turn; keep the "
            "reference answer in user_data, or encode() without add_generation_prompt",
        )
    return messages


def encode_prompt(template: Template, messages: Any, index: int) -> dict[str, Any] | None:
    """One prompt's tokens (None when ``truncation_strategy='delete'`` drops it)."""
    messages = _prompt_messages(messages, index)
    for i, m in enumerate(messages):  # a text template would drop the images and prompt with the text
        if m.get("images") and not getattr(template, "encodes_images", False):
            raise BadRow(
                index,
                f"messages[{i}].images",
                f": messages[{i}] has images, but {type(template).__name__} reads text only; "
                "use a vision-language template and model",
            )
    tokenizer = template.tokenizer
    if template.use_chat_template is False:  # plain text: the message is the prompt
        ids = tokenizer(messages[0]["content"], add_special_tokens=True)["input_ids"]
    else:
        text = template.render(template.with_default_system(messages), add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    n, limit = len(ids), template.max_length
    if n > limit:
        strategy = template.truncation_strategy
        if strategy == "raise":
            raise UserError(
                f"prompt {index} has {n} tokens, more than --max-length {limit}; raise --max-length or pass "
                "--truncation-strategy left or delete"
            )
        if strategy == "delete":
            return None
        ids = ids[n - limit :] if strategy == "left" else ids[:limit]
    n = len(ids)
    return {
        "input_ids": list(ids),
        "labels": [IGNORE_INDEX] * n,
        "attention_mask": [1] * n,
        "position_ids": list(range(n)),
        "length": n,
    }


class PromptEncoder:
    """A batch of rows -> the same rows with their prompt's columns; a dropped row goes, a bad
    row (with ``skip_bad_rows``) stays marked (``length`` -1, ``BAD_COLUMN``) to be reported."""

    def __init__(self, template: Template, skip_bad_rows: bool):
        self.template = template
        self.skip_bad_rows = skip_bad_rows

    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        keys = [k for k in batch if k not in PROMPT_COLUMNS]
        out: dict[str, list] = {k: [] for k in [*keys, *PROMPT_COLUMNS, ROW_COLUMN, BAD_COLUMN]}
        for i, index in enumerate(indices):
            bad = ""
            try:
                encoded = encode_prompt(self.template, batch["messages"][i], index)
            except BadRow as exc:
                if not self.skip_bad_rows:
                    raise
                encoded, bad = {k: [] for k in PROMPT_COLUMNS}, json.dumps([exc.field, exc.text])
                encoded["length"] = -1
            if encoded is None:
                continue
            for k in keys:
                out[k].append(batch[k][i])
            for k in PROMPT_COLUMNS:
                out[k].append(encoded[k])
            out[ROW_COLUMN].append(index)
            out[BAD_COLUMN].append(bad)
        return out


def encode_prompts(
    data: datasets.Dataset,
    template: Template,
    batch_size: int,
    num_proc: int | None,
    skip_bad_rows: bool,
) -> tuple[datasets.Dataset, dict[str, Any]]:
    """``data`` with each row's prompt columns, and ``info`` as ``encode_rows`` gives it (the
    rows keep ``ROW_COLUMN``)."""
    encoded = data.map(
        PromptEncoder(template, skip_bad_rows),
        batched=True,
        batch_size=batch_size,
        with_indices=True,
        remove_columns=data.column_names,
        keep_in_memory=True,
        num_proc=cap_num_proc(num_proc, len(data), "encode"),
        new_fingerprint=generate_random_fingerprint(),
        desc="encode prompts",
    )
    lengths = np.asarray(encoded["length"], dtype=np.int64)
    bad_at, keep = np.flatnonzero(lengths < 0), np.flatnonzero(lengths >= 0)
    bad = [
        [encoded[int(i)][ROW_COLUMN], *json.loads(encoded[int(i)][BAD_COLUMN])] for i in bad_at[:_KEPT_BAD]
    ]
    info = {"rows": len(data), "dropped": len(data) - len(encoded), "bad": bad, "bad_count": len(bad_at)}
    if len(keep) < len(encoded):
        encoded = encoded.select(keep)
    return encoded.remove_columns([BAD_COLUMN]), info
