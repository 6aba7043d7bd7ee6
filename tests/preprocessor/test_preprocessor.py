"""Tests for twinkle.preprocessor: SelfCognitionProcessor and the bundled self-cognition rows."""

import json
from collections import Counter

import pytest

from twinkle.hub.dataset import identity_rows_path
from twinkle.preprocessor import SelfCognitionProcessor
from twinkle.utils.errors import UserError


def test_fills_name_and_author_into_a_three_message_chat():
    processor = SelfCognitionProcessor("twinkle大模型", "ModelScope社区")
    row = {"query": "Is {{NAME}} yours?", "response": "I am {{NAME}}, made by {{AUTHOR}}.", "tag": "en"}
    messages = processor.preprocess(row, index=0)["messages"]

    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    assert messages[0]["content"] == processor.system
    assert messages[1]["content"] == "Is twinkle大模型 yours?"
    assert messages[2]["content"] == "I am twinkle大模型, made by ModelScope社区."


def test_custom_system_prompt():
    messages = SelfCognitionProcessor("n", "a", system="Be brief.").preprocess(
        {"query": "q", "response": "r"}
    )["messages"]
    assert messages[0] == {"role": "system", "content": "Be brief."}


@pytest.mark.parametrize("missing", ["query", "response"])
def test_missing_field_names_row_and_field(missing):
    row = {"query": "q", "response": "r"}
    del row[missing]
    with pytest.raises(UserError, match=rf"row 5 .*{missing}"):
        SelfCognitionProcessor("n", "a").preprocess(row, index=5)


def test_non_text_field_is_rejected():
    with pytest.raises(UserError, match="response"):
        SelfCognitionProcessor("n", "a").preprocess({"query": "q", "response": None}, index=0)


def test_bundled_self_cognition_rows():
    lines = identity_rows_path().read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]

    assert len(rows) >= 100
    assert all(set(row) == {"query", "response", "tag"} for row in rows)
    assert all(row["query"].strip() and row["response"].strip() for row in rows)
    tags = Counter(row["tag"] for row in rows)
    assert set(tags) == {"zh", "en"}
    assert 0.4 <= tags["zh"] / len(rows) <= 0.6
    # Every row is about the model's identity, so it names the model or its author.
    texts = [row["query"] + row["response"] for row in rows]
    assert all("{{NAME}}" in text or "{{AUTHOR}}" in text for text in texts)
    assert sum("{{NAME}}" in text for text in texts) >= len(rows) // 2
