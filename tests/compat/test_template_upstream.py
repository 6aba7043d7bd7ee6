"""Templates in upstream's call shapes: built from a model id, ``encode`` / ``batch_encode`` of
``Trajectory`` dicts (with ``add_generation_prompt``), ``decode``, ``template.tokenizer``, and
``Qwen3_5Template`` on a ChatML model that is not Qwen (the bundled SmolLM2)."""

import pytest

from twinkle.sampler import TorchSampler
from twinkle.template import Qwen3_5Template, Template, get_template
from twinkle.template.rows import IGNORE_INDEX
from twinkle.utils.errors import UserError

TRAJ = {
    "messages": [
        {"role": "system", "content": "You are a helpful math assistant."},
        {"role": "user", "content": "What is 2 + 3?"},
    ],
    "user_data": [["answer", "5"]],
}
CHAT = {"messages": [*TRAJ["messages"], {"role": "assistant", "content": "It is 5."}]}


def test_built_from_a_model_id_holds_the_tokenizer_not_the_string(tiny_model_dir):
    template = Template(str(tiny_model_dir), max_length=64)
    assert template.model_id == str(tiny_model_dir)
    assert not isinstance(template.tokenizer, str)
    assert template.tokenizer.convert_tokens_to_ids("<|im_end|>") == template.tokenizer.eos_token_id
    assert template.processor is template.tokenizer


def test_prompt_encoding_ends_with_the_generation_prompt_and_supervises_nothing(tiny_model_dir):
    template = Qwen3_5Template(model_id=str(tiny_model_dir), enable_thinking=False)
    row = template.encode(TRAJ, add_generation_prompt=True)
    text = template.decode(row["input_ids"])
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert text.startswith("<|im_start|>system\nYou are a helpful math assistant.<|im_end|>")
    assert row["labels"] == [IGNORE_INDEX] * len(row["input_ids"])
    assert row["position_ids"] == list(range(row["length"])) and row["length"] == len(row["input_ids"])
    # the trajectory's own keys travel with the row: a reward reads them after sampling
    assert row["messages"] == TRAJ["messages"] and row["user_data"] == TRAJ["user_data"]
    # an empty assistant turn at the end (upstream's prompt rows) is the turn being opened
    empty = {"messages": [*TRAJ["messages"], {"role": "assistant", "content": ""}]}
    assert template.encode(empty, add_generation_prompt=True)["input_ids"] == row["input_ids"]


def test_encoded_ids_answer_tolist_as_upstream_arrays_do(tiny_model_dir):
    template = Template(str(tiny_model_dir))
    row = template.encode(TRAJ)
    ids, labels = row["input_ids"].tolist(), row["labels"].tolist()
    assert type(ids) is list and ids == list(row["input_ids"]) and labels == list(row["labels"])
    assert type(row["input_ids"] + [0]) is list  # still a list: concatenation, not addition


def test_training_encoding_of_a_trajectory_supervises_the_reply(tiny_model_dir):
    template = Template(str(tiny_model_dir))
    row = template.encode(CHAT)
    supervised = [
        t for t, label in zip(row["input_ids"], row["labels"], strict=True) if label != IGNORE_INDEX
    ]
    assert template.decode(supervised) == "It is 5.<|im_end|>\n"
    assert row["messages"] == CHAT["messages"]
    assert template.encode(CHAT["messages"]).keys() == {
        "input_ids",
        "labels",
        "attention_mask",
        "position_ids",
        "length",
    }


def test_batch_encode_takes_rows_or_columns_and_drops_what_delete_drops(tiny_model_dir):
    n = Template(str(tiny_model_dir)).encode(TRAJ, add_generation_prompt=True)["length"]
    template = Template(str(tiny_model_dir), max_length=n, truncation_strategy="delete")
    long = {"messages": [{"role": "user", "content": "word " * 60}]}
    rows = template.batch_encode([TRAJ, long, TRAJ], add_generation_prompt=True)
    assert len(rows) == 2 and rows[0]["input_ids"] == template.encode(TRAJ, True)["input_ids"]
    columns = template.batch_encode(
        {"messages": [TRAJ["messages"], long["messages"]]}, add_generation_prompt=True
    )
    assert columns["input_ids"] == [rows[0]["input_ids"]]


def test_decode_honours_skip_special_tokens(tiny_model_dir):
    template = Template(str(tiny_model_dir))
    ids = template.encode(TRAJ, add_generation_prompt=True)["input_ids"]
    assert "<|im_start|>" in template.decode(ids)
    assert "<|im_start|>" not in template.decode(ids, skip_special_tokens=True)
    assert template.batch_decode([ids], skip_special_tokens=True) == [
        template.decode(ids, skip_special_tokens=True)
    ]


def test_qwen_template_on_the_bundled_smollm2_renders_chatml_with_its_tokenizer():
    template = Qwen3_5Template("HuggingFaceTB/SmolLM2-135M-Instruct", enable_thinking=False)
    ids = template.encode(TRAJ, add_generation_prompt=True)["input_ids"]
    start, end = template.tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids[0] == start and ids.count(start) == 3 and ids.count(end) == 2  # one token each, not text
    assert template.decode(ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


class _NoChatML:
    """A tokenizer whose vocabulary has no ChatML markers."""

    chat_template = None
    name_or_path = "plain-model"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, **_):
        return "".join(chr(i) for i in ids)

    def get_vocab(self):
        return {"a": 97}


def test_qwen_template_on_a_tokenizer_without_chatml_is_one_line():
    with pytest.raises(UserError) as caught:
        Qwen3_5Template(_NoChatML())
    assert str(caught.value) == (
        "Qwen3_5Template writes ChatML, but the tokenizer of plain-model has no <|im_start|>, <|im_end|> token; "
        "use Template (the model's own chat template)"
    )


def test_unknown_template_keywords_and_inputs_are_one_line(tiny_model_dir):
    cases = [
        (
            lambda: get_template("Qwen3_5Template", str(tiny_model_dir), thinking=False),
            "unknown keyword(s) thinking",
        ),
        (lambda: Template(42), "Template(model_id=...) takes a model id or folder, got int"),
        (lambda: Template(str(tiny_model_dir)).encode({"text": "hi"}), "the trajectory has no 'messages'"),
        (lambda: Template(str(tiny_model_dir)).batch_encode("hi"), "batch_encode got str"),
    ]
    for call, needle in cases:
        with pytest.raises(UserError, match=needle.replace("(", r"\(").replace(")", r"\)")) as caught:
            call()
        assert "\n" not in str(caught.value)


def test_sampler_set_template_renders_prompts_as_the_template_encodes_them(tiny_model_dir):
    sampler = TorchSampler(str(tiny_model_dir))
    sampler.set_template("Qwen3_5Template", model_id=str(tiny_model_dir), enable_thinking=False)
    assert isinstance(sampler.template, Qwen3_5Template) and sampler.template.enable_thinking is False
    (response,) = sampler.sample([TRAJ], {"max_tokens": 2, "seed": 0})
    assert response.prompt_token_ids == sampler.template.encode(TRAJ, add_generation_prompt=True)["input_ids"]
    with pytest.raises(UserError, match=r"Qwen3_5Template: unknown keyword\(s\) thinking"):
        sampler.set_template("Qwen3_5Template", thinking=False)
