"""Tests for twinkle.template: label masks on a multi-turn chat, truncation, the template registry."""

import pytest
from transformers import AutoTokenizer

from twinkle.template import TRUNCATION_STRATEGIES, Qwen3_5Template, Template, get_template
from twinkle.template.base import IGNORE_INDEX
from twinkle.utils.errors import UserError

SYSTEM = "You are a helpful assistant."
REPLIES = ["I am twinkle.", "Paris is in France."]
CHAT = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Who are you?"},
    {"role": "assistant", "content": REPLIES[0]},
    {"role": "user", "content": "Where is Paris?"},
    {"role": "assistant", "content": REPLIES[1]},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def supervised_runs(tokenizer, input_ids: list[int], labels: list[int]) -> list[str]:
    """Decode each maximal run of supervised tokens, checking label == input id token by token."""
    runs, current = [], []
    for token, label in zip(input_ids, labels, strict=True):
        if label == IGNORE_INDEX:
            if current:
                runs.append(current)
            current = []
        else:
            assert label == token
            current.append(token)
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


def test_multi_turn_labels_cover_exactly_each_assistant_reply(tokenizer):
    template = Template(tokenizer, max_length=1024)
    out = template.encode(CHAT)
    full = template.render(CHAT)

    assert full.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n")
    assert out["input_ids"] == tokenizer(full, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(out["input_ids"]) == full
    assert supervised_runs(tokenizer, out["input_ids"], out["labels"]) == [
        r + "<|im_end|>\n" for r in REPLIES
    ]

    # Everything up to the first reply (system, user, "<|im_start|>assistant\n") is masked.
    prefix = template.render(CHAT[:2], add_generation_prompt=True)
    n_prefix = len(tokenizer(prefix, add_special_tokens=False)["input_ids"])
    assert out["labels"][:n_prefix] == [IGNORE_INDEX] * n_prefix
    assert out["labels"][n_prefix] != IGNORE_INDEX

    n = len(out["input_ids"])
    assert out["length"] == n
    assert out["attention_mask"] == [1] * n
    assert out["position_ids"] == list(range(n))


def test_qwen3_5_template_adds_empty_think_block_unsupervised(tokenizer):
    template = Qwen3_5Template(tokenizer, max_length=1024)
    text = template.render(CHAT)
    for reply in REPLIES:
        assert f"<|im_start|>assistant\n<think>\n\n</think>\n\n{reply}<|im_end|>\n" in text
    assert text.count("<think>\n\n</think>\n\n") == len(REPLIES)

    out = template.encode(CHAT)
    assert tokenizer.decode(out["input_ids"]) == text
    assert supervised_runs(tokenizer, out["input_ids"], out["labels"]) == [r + "<|im_end|>" for r in REPLIES]
    assert template.render(CHAT[:2], add_generation_prompt=True).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


@pytest.fixture(scope="module")
def full_encoding(tokenizer):
    return Template(tokenizer, max_length=10_000).encode(CHAT)


def test_truncation_raise_names_sample_and_flag(tokenizer, full_encoding):
    n = len(full_encoding["input_ids"])
    template = Template(tokenizer, max_length=n - 1, truncation_strategy="raise")
    with pytest.raises(UserError, match=r"sample 7 .*--max-length"):
        template.encode(CHAT, index=7)
    assert template.encode(CHAT[:3])["length"] < n  # a shorter chat fits: no error


@pytest.mark.parametrize("strategy", ["left", "right"])
def test_truncation_left_and_right_keep_the_expected_end(tokenizer, full_encoding, strategy):
    limit = 20
    out = Template(tokenizer, max_length=limit, truncation_strategy=strategy).encode(CHAT)
    keep = slice(-limit, None) if strategy == "left" else slice(0, limit)
    assert out["input_ids"] == full_encoding["input_ids"][keep]
    assert out["labels"] == full_encoding["labels"][keep]
    assert out["length"] == limit
    assert out["attention_mask"] == [1] * limit
    assert out["position_ids"] == list(range(limit))


def test_truncation_delete_drops_long_rows_only(tokenizer, full_encoding):
    n = len(full_encoding["input_ids"])
    assert Template(tokenizer, max_length=n - 1, truncation_strategy="delete").encode(CHAT) is None
    assert Template(tokenizer, max_length=n, truncation_strategy="delete").encode(CHAT) == full_encoding


def test_unknown_truncation_strategy_lists_valid_ones(tokenizer):
    with pytest.raises(UserError) as info:
        Template(tokenizer, truncation_strategy="middle")
    assert "middle" in str(info.value)
    assert all(s in str(info.value) for s in TRUNCATION_STRATEGIES)


def test_get_template_by_name_class_and_unknown_name(tokenizer):
    assert type(get_template("Template", tokenizer)) is Template
    assert type(get_template("Qwen3_5Template", tokenizer, max_length=8)) is Qwen3_5Template
    assert get_template(Qwen3_5Template, tokenizer, max_length=8).max_length == 8
    with pytest.raises(UserError, match=r"'Llama3Template'.*Template, Qwen3_5Template"):
        get_template("Llama3Template", tokenizer)
