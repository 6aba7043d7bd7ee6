"""Tests for twinkle.dataset: load -> map(preprocessor) -> set_template -> encode on a tiny jsonl."""

import json

import pytest

from twinkle.dataset import Dataset, DatasetMeta
from twinkle.preprocessor import SelfCognitionProcessor
from twinkle.template.base import IGNORE_INDEX
from twinkle.utils.errors import UserError

ROWS = [
    {"query": "Who are you?", "response": "I am {{NAME}}.", "tag": "en"},
    {"query": "你是谁？", "response": "我是{{NAME}}，由{{AUTHOR}}开发。", "tag": "zh"},
    {"query": "Who made you?", "response": "{{AUTHOR}} made me. " * 20, "tag": "en"},  # the long row
]
COLUMNS = ["input_ids", "labels", "attention_mask", "position_ids", "length"]


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in ROWS), encoding="utf-8")
    return str(path)


def build(jsonl, model_dir, data_slice=None, max_length=512, strategy="right") -> Dataset:
    dataset = Dataset(DatasetMeta(jsonl, data_slice=data_slice))
    dataset.set_template(
        "Template", model_id=str(model_dir), max_length=max_length, truncation_strategy=strategy
    )
    return dataset.map(SelfCognitionProcessor("twinkle", "ModelScope"))


def test_encode_gives_training_columns(jsonl, tiny_model_dir):
    dataset = build(jsonl, tiny_model_dir).encode()
    assert len(dataset) == len(ROWS)
    assert sorted(dataset.data.column_names) == sorted(COLUMNS)
    row = dataset[0]
    n = row["length"]
    assert len(row["input_ids"]) == len(row["labels"]) == n
    assert row["attention_mask"] == [1] * n and row["position_ids"] == list(range(n))
    supervised = [
        t for t, label in zip(row["input_ids"], row["labels"], strict=True) if label != IGNORE_INDEX
    ]
    assert dataset.template.tokenizer.decode(supervised) == "I am twinkle.<|im_end|>\n"
    assert dataset.pad_token_id == dataset.template.tokenizer.pad_token_id


def test_data_slice_past_the_end_wraps_around(jsonl, tiny_model_dir):
    dataset = Dataset(DatasetMeta(jsonl, data_slice=range(7)))
    assert [dataset[i]["query"] for i in range(7)] == [ROWS[i % 3]["query"] for i in range(7)]

    encoded = build(jsonl, tiny_model_dir, data_slice=range(7)).encode()
    assert [encoded[i]["input_ids"] for i in range(7)] == [encoded[i % 3]["input_ids"] for i in range(7)]
    assert encoded[0]["input_ids"] != encoded[1]["input_ids"]


def test_empty_data_slice_is_an_error(jsonl):
    with pytest.raises(UserError, match="data_slice selects no rows"):
        Dataset(DatasetMeta(jsonl, data_slice=range(0)))


def test_delete_drops_only_long_rows(jsonl, tiny_model_dir):
    short = build(jsonl, tiny_model_dir, strategy="right").encode()
    lengths = [short[i]["length"] for i in range(len(ROWS))]
    limit = max(lengths[:2])
    assert lengths[2] > limit

    kept = build(jsonl, tiny_model_dir, max_length=limit, strategy="delete").encode()
    assert [kept[i]["input_ids"] for i in range(len(kept))] == [short[i]["input_ids"] for i in range(2)]


def test_right_truncation_caps_every_row(jsonl, tiny_model_dir):
    full = build(jsonl, tiny_model_dir, max_length=4096, strategy="right").encode()
    prompt = max(next(j for j, t in enumerate(full[i]["labels"]) if t != -100) for i in range(len(full)))
    shortest = min(full[i]["length"] for i in range(len(full)))
    assert prompt + 1 < shortest  # a cap between them keeps part of every reply
    cap = prompt + 1
    dataset = build(jsonl, tiny_model_dir, max_length=cap, strategy="right").encode()
    assert len(dataset) == len(ROWS)
    assert all(dataset[i]["length"] == cap for i in range(len(ROWS)))


def test_samples_truncated_to_no_reply_token_are_dropped(jsonl, tiny_model_dir):
    # 16 tokens hold only the prompt of every row: nothing would be learnt from them.
    dataset = build(jsonl, tiny_model_dir, max_length=16, strategy="right")
    with pytest.raises(UserError, match="no sample is left"):
        dataset.encode()


def test_all_rows_deleted_is_an_error(jsonl, tiny_model_dir):
    dataset = build(jsonl, tiny_model_dir, max_length=2, strategy="delete")
    with pytest.raises(UserError, match="no sample is left"):
        dataset.encode()


def test_encode_before_set_template_or_map_is_an_error(jsonl, tiny_model_dir):
    dataset = Dataset(DatasetMeta(jsonl)).map(SelfCognitionProcessor("n", "a"))
    with pytest.raises(UserError, match="set_template"):
        dataset.encode()

    dataset = Dataset(DatasetMeta(jsonl)).set_template("Template", model_id=str(tiny_model_dir))
    with pytest.raises(UserError, match=r"map\("):
        dataset.encode()


def test_bundled_dataset_loads_and_encodes(tiny_model_dir):
    dataset = Dataset(DatasetMeta(None, data_slice=range(10)))
    assert len(dataset) == 10
    assert {"query", "response", "tag"} <= set(dataset[0])

    dataset.set_template("Template", model_id=str(tiny_model_dir), max_length=256)
    dataset.map(SelfCognitionProcessor("twinkle", "ModelScope")).encode()
    assert len(dataset) == 10
    text = dataset.template.tokenizer.decode(dataset[0]["input_ids"])
    assert "twinkle" in text and "{{" not in text
    assert any(label != IGNORE_INDEX for label in dataset[0]["labels"])
