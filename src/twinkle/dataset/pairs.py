"""Encoding a preference pair: ``{'positive': Trajectory, 'negative': Trajectory}`` ->
``{'positive': InputFeature, 'negative': InputFeature, 'length': tokens of both}``.

Both sides are encoded with the same template. They must share the prompt (the messages
before the reply) and differ in the reply; only the final reply is supervised (assistant turns
inside the prompt get label -100), so the two sides' log-probabilities compare the replies.

A pair longer than ``max_length`` (the longer side counts), by ``truncation_strategy``:

- ``raise``: an error naming the pair, the side and its length;
- ``delete``: the pair is dropped;
- ``right``: each side keeps its first ``max_length`` tokens (the prompt stays whole, the
  replies lose their end); a pair with a side left without reply tokens is dropped;
- ``left``: the same number of tokens is cut from the start of both sides, within the prompt
  they share, so both keep the same end of the prompt and their whole replies; a pair whose
  reply does not fit that way is dropped.

Dropped pairs are counted in one warning line (``drop_reason``)."""

from typing import Any

import datasets

from twinkle.preprocessor.base import BadRow
from twinkle.preprocessor.preference import as_messages, split_pair
from twinkle.template import Template
from twinkle.template.base import IGNORE_INDEX
from twinkle.utils.errors import UserError
from twinkle.utils.values import kind_of

SIDES = ("positive", "negative")
_IDS = datasets.List(datasets.Value("int64"))
SIDE_FEATURES = {
    "input_ids": _IDS,
    "labels": _IDS,
    "attention_mask": _IDS,
    "position_ids": _IDS,
    "length": datasets.Value("int64"),
}
PAIR_FEATURES = {side: SIDE_FEATURES for side in SIDES} | {"length": datasets.Value("int64")}
_EMPTY_SIDE = {"input_ids": [], "labels": [], "attention_mask": [], "position_ids": [], "length": 0}
EMPTY_PAIR = {"positive": _EMPTY_SIDE, "negative": _EMPTY_SIDE, "length": 0}

Tokens = tuple[list[int], list[int]]  # (input_ids, labels)


def holds_pairs(columns: list[str]) -> bool:
    """Rows with ``positive`` and ``negative`` columns are preference pairs."""
    return all(side in columns for side in SIDES)


def check_pair_template(template: Template) -> None:
    if template.use_chat_template is False:
        raise UserError(
            "preference pairs need a chat template (a prompt and a reply), but use_chat_template=False "
            "trains on plain text; drop use_chat_template=False"
        )


def drop_reason(template: Template) -> str:
    """Why pairs were dropped, from the truncation strategy that drops them."""
    limit, strategy = template.max_length, template.truncation_strategy
    if strategy == "right":
        return f"no reply token left on a side after --max-length {limit} with --truncation-strategy right"
    if strategy == "left":
        return (
            f"a reply does not fit in --max-length {limit}: --truncation-strategy left cuts only the "
            "prompt both sides share"
        )
    return f"a side is longer than --max-length {limit} (--truncation-strategy {strategy})"


def _side(row: dict[str, Any], side: str, index: int) -> list[dict[str, str]]:
    value = row.get(side)
    messages = value.get("messages") if isinstance(value, dict) else None
    if not isinstance(messages, list):
        shown = kind_of(value) if not isinstance(value, dict) else "an object without a 'messages' list"
        raise BadRow(index, side, f": {side!r} is {shown}, not a trajectory {{'messages': [...]}}")
    return as_messages(messages, f"{side}.messages", index, "user")


def _prompt_replies(template: Template, prompt: list[dict[str, str]]) -> int:
    """The supervised pieces the prompt renders: its own assistant turns."""
    if not any(m["role"] == "assistant" for m in prompt):
        return 0
    return sum(1 for _, supervised in template.segments(template.with_default_system(prompt)) if supervised)


def _tokens(template: Template, messages: list[dict[str, str]], skip: int, side: str, index: int) -> Tokens:
    ids, labels = template.tokenize(template.with_default_system(messages), skip)
    if all(t == IGNORE_INDEX for t in labels):
        raise BadRow(
            index,
            side,
            f": the {side} reply leaves no token to learn after the template ({type(template).__name__})",
        )
    return ids, labels


def _first_label(labels: list[int]) -> int:
    return next(i for i, t in enumerate(labels) if t != IGNORE_INDEX)


def truncate_pair(template: Template, pair: list[Tokens], index: int) -> list[Tokens] | None:
    """The pair cut to ``max_length`` by the template's strategy (module docstring); None drops it."""
    limit, strategy = template.max_length, template.truncation_strategy
    longest = max(len(ids) for ids, _ in pair)
    if longest <= limit:
        return pair
    if strategy == "raise":
        side = SIDES[0] if len(pair[0][0]) >= len(pair[1][0]) else SIDES[1]
        raise UserError(
            f"pair {index}: the {side} side has {longest} tokens, more than --max-length {limit}; raise "
            "--max-length or pass --truncation-strategy left, right or delete"
        )
    if strategy == "delete":
        return None
    if strategy == "right":
        cut = [(ids[:limit], labels[:limit]) for ids, labels in pair]
        return None if any(all(t == IGNORE_INDEX for t in labels) for _, labels in cut) else cut
    start = longest - limit  # "left": within the prompt, the same cut keeps the sides comparable
    if start > min(_first_label(labels) for _, labels in pair):
        return None
    return [(ids[start:], labels[start:]) for ids, labels in pair]


def _feature(ids: list[int], labels: list[int]) -> dict[str, Any]:
    n = len(ids)
    return {
        "input_ids": ids,
        "labels": labels,
        "attention_mask": [1] * n,
        "position_ids": list(range(n)),
        "length": n,
    }


def encode_pair(template: Template, row: dict[str, Any], index: int) -> dict[str, Any] | None:
    """The encoded pair, or None when truncation drops it. Raises ``BadRow`` for a pair that
    cannot be compared (module docstring) and ``UserError`` under ``truncation_strategy='raise'``."""
    positive, negative = (_side(row, side, index) for side in SIDES)
    shared = split_pair(positive, negative, index, SIDES)
    skip = _prompt_replies(template, positive[:shared])
    pair = [
        _tokens(template, messages, skip, side, index)
        for messages, side in zip((positive, negative), SIDES, strict=True)
    ]
    if pair[0][0] == pair[1][0]:
        raise BadRow(
            index,
            SIDES[0],
            ": 'positive' and 'negative' encode to the same tokens, so the pair teaches no preference; "
            "make the replies differ",
        )
    cut = truncate_pair(template, pair, index)
    if cut is None:
        return None
    sides = [_feature(ids, labels) for ids, labels in cut]
    return {"positive": sides[0], "negative": sides[1], "length": sides[0]["length"] + sides[1]["length"]}
