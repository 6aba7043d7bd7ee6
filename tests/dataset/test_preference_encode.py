"""``Dataset.encode()`` of preference pairs: both sides with the same prompt tokens, only the
final reply supervised, and a defined outcome for a pair longer than ``--max-length`` under each
truncation strategy (``twinkle.dataset.pairs``)."""

import logging

import pytest

from twinkle.dataset import Dataset, DatasetMeta, IterableDataset
from twinkle.preprocessor import PreferenceProcessor
from twinkle.template.base import IGNORE_INDEX
from twinkle.utils.errors import UserError

PROMPT = "Who are you? Tell me your name and who made you."
SHORT, LONG = "I am Twinkle.", "I am ChatGPT, a large language model made by OpenAI, here to help you."


def _pairs(model_dir, rows, max_length=256, strategy="right", skip=False) -> Dataset:
    dataset = Dataset(DatasetMeta(data=rows), skip_bad_rows=skip)
    dataset.set_template(
        "Template", model_id=str(model_dir), max_length=max_length, truncation_strategy=strategy
    )
    return dataset.map(PreferenceProcessor)


def _prompt_length(labels) -> int:
    return next(i for i, t in enumerate(labels) if t != IGNORE_INDEX)


@pytest.fixture
def twinkle_warnings(caplog):
    logger = logging.getLogger("twinkle")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING, logger="twinkle")
    yield caplog
    logger.removeHandler(caplog.handler)


def test_both_sides_share_the_prompt_and_supervise_their_reply(tiny_model_dir):
    dataset = _pairs(tiny_model_dir, [{"prompt": PROMPT, "chosen": SHORT, "rejected": LONG}]).encode()
    row = dataset[0]
    pos, neg = row["positive"], row["negative"]
    start = _prompt_length(pos["labels"])
    assert start == _prompt_length(neg["labels"]) > 0
    assert pos["input_ids"][:start] == neg["input_ids"][:start]
    tokenizer = dataset.template.tokenizer
    for side, reply in ((pos, SHORT), (neg, LONG)):
        supervised = [t for t in side["labels"] if t != IGNORE_INDEX]
        assert tokenizer.decode(supervised).startswith(reply)
        assert side["attention_mask"] == [1] * side["length"] and side["position_ids"] == list(
            range(side["length"])
        )
    assert row["length"] == pos["length"] + neg["length"]


def test_assistant_turns_inside_the_prompt_are_not_supervised(tiny_model_dir):
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there!"}]
    rows = [{"messages": [*history, {"role": "user", "content": PROMPT}], "chosen": SHORT, "rejected": LONG}]
    row = _pairs(tiny_model_dir, rows).encode()[0]
    tokenizer = (
        Dataset(DatasetMeta(data=[{"a": 1}]))
        .set_template("Template", model_id=str(tiny_model_dir))
        .template.tokenizer
    )
    supervised = tokenizer.decode([t for t in row["positive"]["labels"] if t != IGNORE_INDEX])
    assert "Hello there" not in supervised and supervised.startswith(SHORT)


def _long_rows():
    return [
        {"prompt": "Hi", "chosen": SHORT, "rejected": "No."},
        {"prompt": PROMPT, "chosen": SHORT, "rejected": LONG},  # the long pair
    ]


def _token_lengths(model_dir):
    row = _pairs(model_dir, _long_rows()).encode()[1]
    return row["positive"]["length"], row["negative"]["length"], _prompt_length(row["positive"]["labels"])


def test_raise_names_the_pair_and_side_in_one_line(tiny_model_dir):
    pos, neg, _ = _token_lengths(tiny_model_dir)
    limit = neg - 1
    with pytest.raises(UserError) as info:
        _pairs(tiny_model_dir, _long_rows(), max_length=limit, strategy="raise").encode()
    assert str(info.value) == (
        f"pair 1: the negative side has {neg} tokens, more than --max-length {limit}; raise --max-length "
        "or pass --truncation-strategy left, right or delete"
    )


def test_delete_drops_the_pair_with_one_warning(tiny_model_dir, twinkle_warnings):
    _, neg, _ = _token_lengths(tiny_model_dir)
    dataset = _pairs(tiny_model_dir, _long_rows(), max_length=neg - 1, strategy="delete").encode()
    assert len(dataset) == 1 and dataset[0]["negative"]["length"] < neg
    warnings = [r.getMessage() for r in twinkle_warnings.records]
    assert warnings == [
        f"1 of 2 pairs dropped: a side is longer than --max-length {neg - 1} (--truncation-strategy delete)"
    ]


def test_right_cuts_the_replies_and_keeps_the_prompt(tiny_model_dir):
    pos, neg, prompt = _token_lengths(tiny_model_dir)
    limit = (max(pos, prompt + 1) + neg) // 2  # the long side is cut, the short one stays whole
    assert pos <= limit < neg
    full = _pairs(tiny_model_dir, _long_rows()).encode()[1]
    row = _pairs(tiny_model_dir, _long_rows(), max_length=limit, strategy="right").encode()[1]
    assert row["negative"]["input_ids"] == full["negative"]["input_ids"][:limit]
    assert row["positive"] == full["positive"]
    assert _prompt_length(row["negative"]["labels"]) == prompt


def test_right_drops_a_pair_whose_prompt_fills_max_length(tiny_model_dir, twinkle_warnings):
    _, _, prompt = _token_lengths(tiny_model_dir)
    dataset = _pairs(tiny_model_dir, _long_rows(), max_length=prompt, strategy="right").encode()
    assert len(dataset) == 1
    assert [r.getMessage() for r in twinkle_warnings.records] == [
        f"1 of 2 pairs dropped: no reply token left on a side after --max-length {prompt} with --truncation-strategy right"
    ]


def test_left_cuts_the_same_prompt_tokens_from_both_sides(tiny_model_dir):
    pos, neg, prompt = _token_lengths(tiny_model_dir)
    cut = 3
    assert cut < prompt
    full = _pairs(tiny_model_dir, _long_rows()).encode()[1]
    row = _pairs(tiny_model_dir, _long_rows(), max_length=neg - cut, strategy="left").encode()[1]
    for side in ("positive", "negative"):
        assert row[side]["input_ids"] == full[side]["input_ids"][cut:]
        assert row[side]["labels"] == full[side]["labels"][cut:]
    assert row["positive"]["input_ids"][: prompt - cut] == row["negative"]["input_ids"][: prompt - cut]


def test_left_drops_a_pair_whose_reply_does_not_fit(tiny_model_dir, twinkle_warnings):
    pos, neg, prompt = _token_lengths(tiny_model_dir)
    limit = neg - prompt - 1  # the long reply alone is longer
    dataset = _pairs(tiny_model_dir, _long_rows(), max_length=limit, strategy="left").encode()
    assert len(dataset) == 1
    assert [r.getMessage() for r in twinkle_warnings.records] == [
        f"1 of 2 pairs dropped: a reply does not fit in --max-length {limit}: --truncation-strategy left cuts "
        "only the prompt both sides share"
    ]


def test_rows_a_function_built_are_checked_too(tiny_model_dir):
    user = {"role": "user", "content": "Q"}
    rows = [
        {
            "positive": {"messages": [user, {"role": "assistant", "content": "A"}]},
            "negative": {"messages": [user, {"role": "assistant", "content": "B"}]},
        },
        {
            "positive": {"messages": [user, {"role": "assistant", "content": "A"}]},
            "negative": {
                "messages": [{"role": "user", "content": "Other"}, {"role": "assistant", "content": "B"}]
            },
        },
    ]
    dataset = Dataset(DatasetMeta(data=rows), skip_bad_rows=False)
    dataset.set_template("Template", model_id=str(tiny_model_dir))
    with pytest.raises(UserError) as info:
        dataset.encode()
    assert str(info.value).startswith(
        "DatasetMeta(data=...): row 1: 'positive' and 'negative' share no prompt"
    ), str(info.value)
    skipped = Dataset(DatasetMeta(data=rows), skip_bad_rows=True)
    skipped.set_template("Template", model_id=str(tiny_model_dir))
    assert len(skipped.encode()) == 1


def test_encoded_pairs_come_back_from_the_cache(tiny_model_dir):
    rows = [{"prompt": PROMPT, "chosen": SHORT, "rejected": LONG}]
    first = _pairs(tiny_model_dir, rows).encode(load_from_cache_file=True)
    again = _pairs(tiny_model_dir, rows).encode(load_from_cache_file=True)
    assert again[0] == first[0]


def test_a_stream_encodes_pairs_the_same_way(tiny_model_dir):
    rows = _long_rows()
    stream = IterableDataset(DatasetMeta(data=rows))
    stream.set_template("Template", model_id=str(tiny_model_dir), max_length=256)
    stream.map(PreferenceProcessor()).encode()
    assert list(stream) == [_pairs(tiny_model_dir, rows).encode()[i] for i in range(2)]
