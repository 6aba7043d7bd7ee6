"""Encoding: every row's ``messages`` to ``input_ids``, ``labels``, ``attention_mask``,
``position_ids`` and ``length`` with a template, optionally through the on-disk cache. Rows
holding preference pairs (``positive`` and ``negative`` trajectories) become a pair of such
samples each (``twinkle.dataset.pairs``).

A row that leaves nothing to learn once the template has rendered it (no assistant reply after
another turn, a reply that renders to nothing) is a bad row (``BadRow``): an error naming its
file and line, or, with ``skip_bad_rows``, dropped and reported. A sample whose reply tokens
truncation cut away is dropped with a warning, as ``--truncation-strategy`` asks."""

import functools
import json
from typing import Any

import datasets
import numpy as np
from datasets.fingerprint import generate_random_fingerprint

from twinkle.dataset import image_rows
from twinkle.dataset import pairs as pairs_module
from twinkle.dataset import prompts as prompts_module
from twinkle.dataset.cache import Built, EncodeCache, encode_key
from twinkle.dataset.ops import ROW_COLUMN, cap_num_proc
from twinkle.dataset.origin import RowOrigin, bad_rows_text, located, report_skipped
from twinkle.preprocessor.base import BadRow
from twinkle.template import Template
from twinkle.template.base import IGNORE_INDEX
from twinkle.template.images import BadImage, tagged_messages
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger
from twinkle.utils.values import kind_of

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
# Each output row also says which input row it is (``ROW_COLUMN``) and, for a bad row that
# ``skip_bad_rows`` keeps out (``length`` -1), what is wrong with it (``BAD_COLUMN``: JSON
# ``[field, text]``). Both are removed before the rows are handed out.
BAD_COLUMN = "__twinkle_bad__"
_OUT_FEATURES = datasets.Features(
    {**FEATURES, ROW_COLUMN: datasets.Value("int64"), BAD_COLUMN: datasets.Value("string")}
)
_PAIR_OUT_FEATURES = datasets.Features(
    {**pairs_module.PAIR_FEATURES, ROW_COLUMN: datasets.Value("int64"), BAD_COLUMN: datasets.Value("string")}
)
_EMPTY = {"input_ids": [], "labels": [], "attention_mask": [], "position_ids": [], "length": 0}
_KEPT_BAD = 20  # bad rows whose reasons an encoding keeps (the summary quotes the first few)


def _check_encodable(messages: Any, index: int) -> None:
    """What the template needs of every row, whoever wrote its ``messages``: a list of messages
    whose ``role`` is text and whose ``content`` is text or upstream's content parts (a list,
    read by ``twinkle.template.images``) (rows a function built, not a preprocessor)."""
    if not isinstance(messages, list) or not messages:
        raise BadRow(
            index,
            "messages",
            f": 'messages' is {kind_of(messages)}, not a list of messages",
        )
    for i, m in enumerate(messages):
        for key in ("role", "content"):
            value = m.get(key) if isinstance(m, dict) else None
            if not isinstance(value, str) and not (key == "content" and isinstance(value, list)):
                raise BadRow(
                    index, f"messages[{i}].{key}", f": messages[{i}].{key} is {kind_of(value)}, not text"
                )


def _refuse_images(template: Template, messages: list[dict[str, Any]], index: int) -> None:
    """A text template would drop a row's images and train on the text alone."""
    for i, m in enumerate(messages):
        content = m.get("content")
        parts = (
            [j for j, p in enumerate(content) if isinstance(p, dict) and p.get("type") == "image"]
            if isinstance(content, list)
            else []
        )
        if m.get("images") or parts:
            field = f"messages[{i}].content[{parts[0]}]" if parts else f"messages[{i}].images"
            raise BadRow(
                index,
                field,
                f": messages[{i}] has images, but {type(template).__name__} reads text only; "
                "use a vision-language template (--template-cls Qwen2_5VLTemplate) and model",
            )


def _as_text(messages: list[dict[str, Any]], index: int) -> list[dict[str, Any]]:
    """Turns given as text-only content parts joined into their text, for a text template."""
    try:
        turns = tagged_messages(messages, index)
    except BadImage as exc:  # a part of another type
        raise BadRow(exc.index, exc.field, exc.text) from None
    return [{k: v for k, v in m.items() if k != "images" or v} for m in turns]


def _learns_something(template: Template, messages: list[dict[str, str]]) -> bool:
    _, labels = template.tokenize(template.with_default_system(messages))
    return any(t != IGNORE_INDEX for t in labels)


def _encode_one(template: Template, messages: list[dict[str, str]], index: int) -> dict[str, Any] | None:
    """The encoded sample, or None when truncation drops it (``delete``, or no reply token left:
    such a sample costs a forward and backward and teaches nothing). Raises ``BadRow`` when the
    row itself has nothing to learn."""
    _check_encodable(messages, index)
    if not getattr(template, "encodes_images", False):
        _refuse_images(template, messages, index)
        messages = _as_text(messages, index)
    try:
        out = template.encode(messages, index=index)
    except BadImage as exc:  # a vision template's image: a bad row like any other
        raise BadRow(exc.index, exc.field, exc.text) from None
    if out is None or any(t != IGNORE_INDEX for t in out["labels"]):
        return out
    # Truncation yields exactly max_length tokens; a shorter sample was never cut.
    if out["length"] < template.max_length or not _learns_something(template, messages):
        raise BadRow(
            index,
            "messages",
            f": 'messages' leaves no token to learn after the template ({type(template).__name__}): "
            "no assistant reply is rendered after another turn",
        )
    return None


class _Encoder:
    """Encodes conversations (``messages``) or, with ``pairs``, preference pairs."""

    def __init__(
        self,
        template: Template,
        skip_bad_rows: bool,
        pairs: bool = False,
    ):
        self.template = template
        self.skip_bad_rows = skip_bad_rows
        self.pairs = pairs
        # a vision template's samples keep their pictures, not its tensors (twinkle.dataset.image_rows)
        self.images = getattr(template, "encodes_images", False) and not pairs
        self.empty = pairs_module.EMPTY_PAIR if pairs else _EMPTY
        self.features = _PAIR_OUT_FEATURES if pairs else _OUT_FEATURES
        if self.images:
            self.empty = {**self.empty, image_rows.IMAGES: []}
            self.features = datasets.Features({**self.features, image_rows.IMAGES: image_rows.IMAGES_FEATURE})

    def one(self, row: dict[str, Any], index: int) -> dict[str, Any]:
        """The sample, ``empty`` when truncation drops it, a marker for a bad row that is skipped."""
        try:
            if self.pairs:
                out = pairs_module.encode_pair(self.template, row, index)
            else:
                out = _encode_one(self.template, row["messages"], index)
        except BadRow as exc:
            if not self.skip_bad_rows:
                raise
            return {
                **self.empty,
                "length": -1,
                ROW_COLUMN: index,
                BAD_COLUMN: json.dumps([exc.field, exc.text]),
            }
        if out is None:
            return {**self.empty, ROW_COLUMN: index, BAD_COLUMN: ""}
        if self.images:
            out = {**out, image_rows.IMAGES: image_rows.stored_images(row["messages"], index)}
        out = {**out, ROW_COLUMN: index, BAD_COLUMN: ""}
        return {key: out[key] for key in self.features}


class _BatchEncoder(_Encoder):
    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        columns: dict[str, list] = {key: [] for key in self.features}
        keys = pairs_module.SIDES if self.pairs else ("messages",)
        for i, index in enumerate(indices):
            out = self.one({key: batch[key][i] for key in keys}, index)
            for key in self.features if out["length"] != 0 else ():
                columns[key].append(out[key])
        return columns


class _RowEncoder(_Encoder):
    def __call__(self, row: dict[str, Any], index: int) -> dict[str, Any]:
        return self.one(row, index)


def _no_sample_left(template: Template) -> UserError:
    return UserError(
        f"no sample is left after encoding with --max-length {template.max_length} and "
        f"--truncation-strategy {template.truncation_strategy}; raise --max-length"
    )


def encode_rows(
    data: datasets.Dataset,
    template: Template,
    batched: bool,
    batch_size: int,
    num_proc: int | None,
    skip_bad_rows: bool = False,
) -> Built:
    """Encode ``data`` in memory; ``batched`` and ``num_proc`` change the speed, never the result.
    The rows keep ``ROW_COLUMN``; ``info`` counts the rows truncation dropped and lists the bad
    rows ``skip_bad_rows`` dropped (``bad``: ``[index, field, text]``, the first few)."""
    pairs = pairs_module.holds_pairs(data.column_names)
    if pairs:
        pairs_module.check_pair_template(template)
    columns = _Encoder(template, skip_bad_rows, pairs).features
    common: dict[str, Any] = dict(
        with_indices=True,
        remove_columns=data.column_names,
        keep_in_memory=True,
        features=columns,
        num_proc=cap_num_proc(num_proc, len(data), "encode"),
        new_fingerprint=generate_random_fingerprint(),
        desc="encode",
    )
    if batched:
        encoder: Any = _BatchEncoder(template, skip_bad_rows, pairs)
        encoded = data.map(encoder, batched=True, batch_size=batch_size, **common)
    else:
        encoded = data.map(_RowEncoder(template, skip_bad_rows, pairs), **common)
    lengths = np.asarray(encoded["length"], dtype=np.int64)
    bad_at, keep = np.flatnonzero(lengths < 0), np.flatnonzero(lengths > 0)
    bad = [
        [encoded[int(i)][ROW_COLUMN], *json.loads(encoded[int(i)][BAD_COLUMN])] for i in bad_at[:_KEPT_BAD]
    ]
    if len(keep) == 0 and len(bad_at) == 0:
        raise _no_sample_left(template)
    if len(keep) < len(encoded):
        encoded = encoded.select(keep)
    info = {
        "rows": len(data),
        "dropped": len(data) - len(keep) - len(bad_at),
        "bad": bad,
        "bad_count": len(bad_at),
    }
    return encoded.remove_columns([BAD_COLUMN]), info


def encode_dataset(
    data: datasets.Dataset,
    template: Template,
    batched: bool,
    batch_size: int,
    num_proc: int | None,
    load_from_cache_file: bool,
    origin: RowOrigin | None = None,
    skip_bad_rows: bool = False,
    prompts: bool = False,
) -> tuple[datasets.Dataset, RowOrigin]:
    """Encoded rows and their origin: built here, or with ``load_from_cache_file`` loaded from
    (and else stored in) the cache under ``cache_root()``, keyed by the rows' content, the
    template and its settings, the tokenizer, and this code.

    A bad row is an error naming its file and line (``origin``), also when the cached rows were
    encoded with ``skip_bad_rows``; with ``skip_bad_rows`` the rows dropped are logged in one line."""
    origin = origin if origin is not None else RowOrigin.in_place("the rows", len(data))
    if prompts:  # add_generation_prompt: the prompts a sampler completes (twinkle.dataset.prompts)
        build = functools.partial(
            prompts_module.encode_prompts, data, template, batch_size, num_proc, skip_bad_rows
        )
    else:
        build = functools.partial(encode_rows, data, template, batched, batch_size, num_proc, skip_bad_rows)
    try:
        if load_from_cache_file:
            modules = (__name__, pairs_module.__name__, prompts_module.__name__, image_rows.__name__)
            key = encode_key(data, template, *modules)
            key["prompts"] = prompts
            encoded, info = EncodeCache(key).get_or_build(build)
        else:
            encoded, info = build()
    except BadRow as exc:
        raise located(exc, origin) from exc
    bad = [(index, BadRow(index, field, text)) for index, field, text in info.get("bad", [])]
    if bad and not skip_bad_rows:
        raise located(bad[0][1], origin)
    report_skipped(bad_rows_text(bad, origin), info.get("bad_count", 0), info["rows"], "encode")
    kept = encoded[ROW_COLUMN]
    encoded = encoded.remove_columns([ROW_COLUMN])
    if len(encoded) == 0:
        raise _no_sample_left(template)
    if info.get("dropped") and prompts:
        logger.warning(
            f"{info['dropped']} of {info['rows']} prompts dropped: longer than --max-length "
            f"{template.max_length} with --truncation-strategy delete"
        )
    elif info.get("dropped") and pairs_module.holds_pairs(data.column_names):
        logger.warning(
            f"{info['dropped']} of {info['rows']} pairs dropped: {pairs_module.drop_reason(template)}"
        )
    elif info.get("dropped"):
        logger.warning(
            f"{info['dropped']} of {info['rows']} samples dropped: no supervised token left after "
            f"--max-length {template.max_length} with --truncation-strategy {template.truncation_strategy}"
        )
    return encoded, origin.take(kept)
