"""The row shapes a template reads and writes: a trajectory's messages, an encoded row, a prompt
row with a sampled reply appended, and rows <-> columns (a batch of ``datasets.map``)."""

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from twinkle.utils.errors import UserError

IGNORE_INDEX = -100
ENCODED_KEYS = ("input_ids", "labels", "attention_mask", "position_ids", "length")


def tokenizer_of(model_id: Any) -> tuple[str | None, Any]:
    """``(model_id, tokenizer)`` for a model id or folder (resolved by ``twinkle.hub``; None is
    the bundled model), or for a tokenizer already loaded (its own ``name_or_path``)."""
    if model_id is None or isinstance(model_id, str | Path):
        from twinkle.template.tokenizer import load_tokenizer

        name = None if model_id is None else str(model_id)
        return name, load_tokenizer(name)
    if callable(model_id) and callable(getattr(model_id, "decode", None)):
        return getattr(model_id, "name_or_path", None) or None, model_id
    raise UserError(f"Template(model_id=...) takes a model id or folder, got {type(model_id).__name__}")


def messages_of(trajectory: Any) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """``(messages, the trajectory as a dict)`` of a ``Trajectory``; ``(messages, None)`` of a
    bare list of messages."""
    if isinstance(trajectory, Mapping):
        if "messages" not in trajectory:
            raise UserError(
                f"encode: the trajectory has no 'messages' (keys: {sorted(trajectory)}); "
                "map the rows with a preprocessor first"
            )
        return list(trajectory["messages"]), dict(trajectory)
    if isinstance(trajectory, str | bytes) or not isinstance(trajectory, Sequence):
        raise UserError(
            f"encode got {type(trajectory).__name__}; pass a Trajectory ({{'messages': [...]}}) "
            "or a list of messages"
        )
    return list(trajectory), None


def without_empty_reply(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A prompt's messages without a trailing assistant turn that has no text (prompt rows
    carry one where every row of a column must have the same turns)."""
    last = messages[-1] if messages else None
    if (
        isinstance(last, Mapping)
        and last.get("role") == "assistant"
        and not (last.get("content") or "").strip()
    ):
        return messages[:-1]
    return messages


def as_ids(values: Any) -> list[int]:
    """A list of ints from a list, a tuple, a numpy array or a 1-D tensor."""
    values = values.tolist() if hasattr(values, "tolist") else list(values)
    return [int(v) for v in values]


def feature_of(input_ids: list[int], labels: list[int]) -> dict[str, Any]:
    """The encoded row of one sample (``twinkle.data_format.InputFeature``)."""
    return {
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": [1] * len(input_ids),
        "position_ids": list(range(len(input_ids))),
        "length": len(input_ids),
    }


def concat_reply(prompt: Mapping[str, Any], tokens: list[int], reply: str) -> dict[str, Any]:
    """``prompt`` (an encoded row; labels ``-100`` where it has none) followed by the sampled
    ``tokens``, which are supervised; the prompt's other keys are kept, and its ``messages``
    (when it has them) gain ``reply`` as an assistant turn."""
    ids = as_ids(prompt["input_ids"])
    labels = as_ids(prompt["labels"]) if "labels" in prompt else [IGNORE_INDEX] * len(ids)
    tokens = [int(t) for t in tokens]
    row = {k: v for k, v in prompt.items() if k not in ENCODED_KEYS}
    row.update(feature_of(ids + tokens, labels + tokens))
    if prompt.get("messages") is not None:
        row["messages"] = [*prompt["messages"], {"role": "assistant", "content": reply}]
    return row


def columns_to_rows(columns: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """``{'key': [v0, v1, ...]}`` -> ``[{'key': v0}, {'key': v1}, ...]``."""
    sizes = {key: len(values) for key, values in columns.items()}
    if len(set(sizes.values())) > 1:
        raise UserError(f"columns of different lengths: {sizes}")
    n = next(iter(sizes.values()), 0)
    return [{key: values[i] for key, values in columns.items()} for i in range(n)]


def rows_to_columns(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """The inverse of ``columns_to_rows`` (the keys of the first row)."""
    if not rows:
        return {}
    return {key: [row.get(key) for row in rows] for key in rows[0]}
