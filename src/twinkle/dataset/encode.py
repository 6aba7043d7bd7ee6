"""Encoding: every row's ``messages`` to ``input_ids``, ``labels``, ``attention_mask``,
``position_ids`` and ``length`` with a template, optionally through the on-disk cache."""

import functools
from typing import Any

import datasets
from datasets.fingerprint import generate_random_fingerprint

from twinkle.dataset.cache import Built, EncodeCache, encode_key
from twinkle.dataset.ops import cap_num_proc
from twinkle.template import Template
from twinkle.template.base import IGNORE_INDEX
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

logger = get_logger()
ENCODED_COLUMNS = ("input_ids", "labels", "attention_mask", "position_ids", "length")
_IDS = datasets.List(datasets.Value("int64"))
# Fixed column types: a batch whose rows all drop still writes the same schema.
FEATURES = datasets.Features(
    {
        "input_ids": _IDS,
        "labels": _IDS,
        "attention_mask": _IDS,
        "position_ids": _IDS,
        "length": datasets.Value("int64"),
    }
)
_EMPTY = {"input_ids": [], "labels": [], "attention_mask": [], "position_ids": [], "length": 0}


def _encode_one(template: Template, messages: list[dict[str, str]], index: int) -> dict[str, Any] | None:
    """The encoded sample, or None when it goes: dropped by ``delete``, or truncated so that no
    reply token is left (such a sample costs a forward and backward and teaches nothing)."""
    out = template.encode(messages, index=index)
    return out if out is not None and any(t != IGNORE_INDEX for t in out["labels"]) else None


class _BatchEncoder:
    def __init__(self, template: Template):
        self.template = template

    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        columns: dict[str, list] = {key: [] for key in ENCODED_COLUMNS}
        for messages, index in zip(batch["messages"], indices, strict=True):
            out = _encode_one(self.template, messages, index)
            for key in ENCODED_COLUMNS if out is not None else ():
                columns[key].append(out[key])
        return columns


class _RowEncoder:
    def __init__(self, template: Template):
        self.template = template

    def __call__(self, row: dict[str, Any], index: int) -> dict[str, Any]:
        return _encode_one(self.template, row["messages"], index) or _EMPTY


def encode_rows(
    data: datasets.Dataset, template: Template, batched: bool, batch_size: int, num_proc: int | None
) -> Built:
    """Encode ``data`` in memory; ``batched`` and ``num_proc`` change the speed, never the result."""
    common: dict[str, Any] = dict(
        with_indices=True,
        remove_columns=data.column_names,
        keep_in_memory=True,
        features=FEATURES,
        num_proc=cap_num_proc(num_proc, len(data), "encode"),
        new_fingerprint=generate_random_fingerprint(),
        desc="encode",
    )
    if batched:
        encoded = data.map(_BatchEncoder(template), batched=True, batch_size=batch_size, **common)
    else:
        encoded = data.map(_RowEncoder(template), **common)
        encoded = encoded.filter(lambda n: n > 0, input_columns=["length"], keep_in_memory=True)
    if len(encoded) == 0:
        raise UserError(
            f"no sample is left after encoding with --max-length {template.max_length} and "
            f"--truncation-strategy {template.truncation_strategy}; raise --max-length"
        )
    return encoded, {"rows": len(data), "dropped": len(data) - len(encoded)}


def encode_dataset(
    data: datasets.Dataset,
    template: Template,
    batched: bool,
    batch_size: int,
    num_proc: int | None,
    load_from_cache_file: bool,
) -> datasets.Dataset:
    """Encoded rows: built here, or with ``load_from_cache_file`` loaded from (and else stored
    in) the cache under ``cache_root()``, keyed by the rows' content, the template and its
    settings, the tokenizer, and this code."""
    build = functools.partial(encode_rows, data, template, batched, batch_size, num_proc)
    if load_from_cache_file:
        encoded, info = EncodeCache(encode_key(data, template, __name__)).get_or_build(build)
    else:
        encoded, info = build()
    if info.get("dropped"):
        logger.warning(
            f"{info['dropped']} of {info['rows']} samples dropped: no supervised token left after "
            f"--max-length {template.max_length} with --truncation-strategy {template.truncation_strategy}"
        )
    return encoded
