"""Preference rows in each common form -> ``{'positive', 'negative'}`` trajectories with the same
prompt; bad rows are one line naming the file, line and field (or dropped with
``--skip-bad-rows``); the bundled preference set is what its script writes."""

import importlib.util
import json
import logging
import re
from pathlib import Path

import pytest

from twinkle.data_format import InputFeature, Message, Trajectory
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.hub.dataset import PREFERENCE_SPLITS, asset_path, bundled_preference_path
from twinkle.preprocessor import (
    DPOProcessor,
    EmojiDPOProcessor,
    PreferenceProcessor,
    SelfCognitionDPOProcessor,
)
from twinkle.preprocessor.base import BadRow
from twinkle.utils.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
USER = {"role": "user", "content": "Who are you?"}
GOOD_REPLY = {"role": "assistant", "content": "I am Twinkle."}
BAD_REPLY = {"role": "assistant", "content": "I am ChatGPT."}
PAIR = {
    "positive": {"messages": [USER, GOOD_REPLY]},
    "negative": {"messages": [USER, BAD_REPLY]},
}

# Each common form of the same pair (one example row each).
FORMS = {
    "text-with-prompt": {"prompt": "Who are you?", "chosen": "I am Twinkle.", "rejected": "I am ChatGPT."},
    "conversational-with-prompt": {"prompt": [USER], "chosen": [GOOD_REPLY], "rejected": [BAD_REPLY]},
    "reply-as-one-message": {"prompt": "Who are you?", "chosen": GOOD_REPLY, "rejected": BAD_REPLY},
    "conversational-implicit-prompt": {"chosen": [USER, GOOD_REPLY], "rejected": [USER, BAD_REPLY]},
    "whole-conversations-beside-a-prompt": {
        "prompt": "Who are you?",
        "chosen": [USER, GOOD_REPLY],
        "rejected": [USER, BAD_REPLY],
    },
    "messages-then-text-replies": {
        "messages": [USER],
        "chosen": "I am Twinkle.",
        "rejected": "I am ChatGPT.",
    },
    "messages-ending-with-chosen": {"messages": [USER, GOOD_REPLY], "rejected": "I am ChatGPT."},
    "swift-rejected-response": {"messages": [USER, GOOD_REPLY], "rejected_response": "I am ChatGPT."},
}


@pytest.mark.parametrize("form", list(FORMS))
def test_each_common_form_becomes_the_same_pair(form):
    out = PreferenceProcessor().preprocess(FORMS[form], 0)
    assert out == PAIR
    json.dumps(out)  # plain records: what a datasets row can hold


def test_system_is_added_only_where_the_prompt_has_none():
    processor = DPOProcessor(system="Be brief.")  # upstream's name of the same reader
    out = processor.preprocess(FORMS["text-with-prompt"], 0)
    assert [m["role"] for m in out["positive"]["messages"]] == ["system", "user", "assistant"]
    assert (
        out["positive"]["messages"][0]
        == out["negative"]["messages"][0]
        == {
            "role": "system",
            "content": "Be brief.",
        }
    )
    own = {"role": "system", "content": "Mine."}
    kept = processor.preprocess({"prompt": [own, USER], "chosen": "a", "rejected": "b"}, 0)
    assert kept["positive"]["messages"][0] == own and len(kept["positive"]["messages"]) == 3


def test_a_multi_turn_prompt_is_shared_by_both_sides():
    prompt = [USER, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name?"}]
    out = PreferenceProcessor().preprocess(
        {"messages": prompt, "chosen": "Twinkle.", "rejected": "ChatGPT."}, 0
    )
    assert out["positive"]["messages"][:3] == out["negative"]["messages"][:3] == prompt
    assert out["positive"]["messages"][3] == {"role": "assistant", "content": "Twinkle."}


def test_emoji_processor_reads_upstreams_columns():
    row = {"prompt": "你好", "answer_zh": "你好呀😊", "answer_en": "Hello."}
    out = EmojiDPOProcessor(system="sys").preprocess(row, 0)
    assert [m["content"] for m in out["positive"]["messages"]] == ["sys", "你好", "你好呀😊"]
    assert out["negative"]["messages"][-1]["content"] == "Hello."
    renamed = EmojiDPOProcessor(chosen_key="good", rejected_key="bad", prompt_key="q")
    assert (
        renamed.preprocess({"q": "x", "good": "y", "bad": "z"}, 0)["negative"]["messages"][-1]["content"]
        == "z"
    )


def test_self_cognition_dpo_fills_name_and_author_everywhere():
    row = {"prompt": "Who is {{NAME}}?", "chosen": "I am {{NAME}} by {{AUTHOR}}.", "rejected": "I am Qwen."}
    out = SelfCognitionDPOProcessor("Twinkle", "Acme").preprocess(row, 0)
    positive = out["positive"]["messages"]
    assert positive[0] == {"role": "system", "content": "You are a helpful assistant."}
    assert positive[1]["content"] == "Who is Twinkle?" and positive[2]["content"] == "I am Twinkle by Acme."
    # filled before the check: a name that makes both replies equal is caught
    with pytest.raises(BadRow, match="are the same reply"):
        SelfCognitionDPOProcessor("Qwen", "x").preprocess(
            {"prompt": "q", "chosen": "I am {{NAME}}.", "rejected": "I am Qwen."}
        )


def test_the_records_are_typed_dicts():
    message: Message = {"role": "user", "content": "hi"}
    trajectory: Trajectory = {"messages": [message]}
    feature: InputFeature = {"input_ids": [1], "labels": [-100]}
    assert isinstance(trajectory, dict) and isinstance(feature, dict)
    assert set(Trajectory.__annotations__) >= {"messages", "tools", "user_data"}


# row 1 of each file (line 3) is bad: (the row, regex of the rest of its message)
BAD_ROWS = {
    "no-rejected": (
        {"prompt": "q", "chosen": "a"},
        r" has no 'rejected' side \(it has chosen, prompt\); every preference row needs a 'chosen' and a 'rejected' reply",
    ),
    "no-chosen": ({"prompt": "q", "rejected": "a"}, r" has no 'chosen' side \(it has prompt, rejected\)"),
    "identical": (
        {"prompt": "q", "chosen": "Same.", "rejected": " Same. "},
        r": 'chosen' and 'rejected' are the same reply, so the pair teaches no preference; make them differ",
    ),
    "empty-reply": ({"prompt": "q", "chosen": " ", "rejected": "b"}, r": 'chosen' is empty"),
    # found when the file is read (the other rows hold text there); the processor names it too
    "number-reply": (
        {"prompt": "q", "chosen": "a", "rejected": 3},
        r": 'rejected' is a number \(3\) where most",
    ),
    "text-without-prompt": (
        {"chosen": "a", "rejected": "b"},
        r" has no 'prompt' or 'messages' before its text",
    ),
    "different-prompts": (
        {
            "prompt": None,
            "chosen": [USER, GOOD_REPLY],
            "rejected": [{"role": "user", "content": "Other?"}, BAD_REPLY],
        },
        r": 'chosen' and 'rejected' share no prompt",
    ),
    "ends-with-a-user-turn": (
        {"prompt": [USER], "chosen": [GOOD_REPLY, USER], "rejected": [BAD_REPLY]},
        r": 'chosen' ends with a user turn, not an assistant reply",
    ),
    "unknown-role": (
        {"prompt": [USER], "chosen": [{"role": "bot", "content": "a"}], "rejected": [BAD_REPLY]},
        r": chosen\[0\]\.role is 'bot'",
    ),
}


def test_a_reply_of_the_wrong_type_is_named_by_the_processor():
    with pytest.raises(
        BadRow, match=r"^row 1: 'rejected' is a number \(3\), not text or a list of messages$"
    ):
        PreferenceProcessor().preprocess({"prompt": "q", "chosen": "a", "rejected": 3}, 1)


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("\n".join([json.dumps(rows[0]), "", *map(json.dumps, rows[1:])]) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_a_bad_preference_row_is_one_line_naming_file_line_and_field(case, tmp_path):
    row, pattern = BAD_ROWS[case]
    # the good rows around it have its columns' types (a file's column holds one type)
    good = FORMS["conversational-with-prompt" if isinstance(row.get("chosen"), list) else "text-with-prompt"]
    path = _jsonl(tmp_path / "pairs.jsonl", [good, row, good])
    with pytest.raises(UserError) as info:
        Dataset(DatasetMeta(str(path)), skip_bad_rows=False).map(PreferenceProcessor)
    message = str(info.value)
    assert "\n" not in message
    assert re.match(re.escape(f"{path}:3: row 1") + pattern, message), message
    assert message.endswith(
        "; fix the row, or pass --skip-bad-rows (Dataset(skip_bad_rows=True)) to drop such rows"
    )


def test_skip_bad_rows_drops_identical_and_one_sided_pairs_and_says_so(tmp_path, caplog):
    good = FORMS["text-with-prompt"]
    rows = [good, BAD_ROWS["identical"][0], good, BAD_ROWS["no-rejected"][0], good]
    path = _jsonl(tmp_path / "pairs.jsonl", rows)
    logger = logging.getLogger("twinkle")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="twinkle"):
            dataset = Dataset(DatasetMeta(str(path)), skip_bad_rows=True).map(PreferenceProcessor)
    finally:
        logger.removeHandler(caplog.handler)
    assert len(dataset) == 3 and all(dataset[i] == PAIR for i in range(3))
    lines = [r.getMessage() for r in caplog.records if "--skip-bad-rows" in r.getMessage()]
    assert len(lines) == 1 and "map dropped 2 of 5 rows" in lines[0]
    assert f"{path}:3: row 1: 'chosen' and 'rejected' are the same reply" in lines[0]


def _build_script():
    spec = importlib.util.spec_from_file_location(
        "build_dpo", ROOT / "scripts" / "build_self_cognition_dpo.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_bundled_pairs_are_what_the_script_writes(tmp_path):
    script = _build_script()
    (tmp_path / "self_cognition_mixed.jsonl").write_bytes(
        asset_path("self_cognition_mixed.jsonl").read_bytes()
    )
    script.main(tmp_path)
    for name in PREFERENCE_SPLITS.values():
        assert (tmp_path / name).read_bytes() == asset_path(name).read_bytes(), name


def _rows(split: str) -> list[dict]:
    return [
        json.loads(line) for line in bundled_preference_path(split).read_text(encoding="utf-8").splitlines()
    ]


def test_the_bundled_pairs_hold_both_languages_and_a_held_out_split():
    train, held_out = _rows("train"), _rows("eval")
    assert [sum(r["tag"] == tag for r in train) for tag in ("zh", "en")] == [60, 60]
    assert [sum(r["tag"] == tag for r in held_out) for tag in ("zh", "en")] == [15, 15]
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    for row in train + held_out:
        assert "{{NAME}}" in row["chosen"] or "{{AUTHOR}}" in row["chosen"]
        assert "{{" not in row["rejected"] and row["rejected"] != row["chosen"]
    # the wrong identities vary: several names, and some answers name nobody at all
    rejected = " ".join(r["rejected"] for r in train)
    assert all(name in rejected for name in ("ChatGPT", "Claude", "Qwen", "通义千问", "文心一言", "Llama"))
    assert sum("没有" in r["rejected"] or "no name" in r["rejected"] for r in train) >= 10


@pytest.mark.parametrize("split", ["train", "eval"])
def test_the_bundled_pairs_load_by_name_without_a_bad_row(split):
    dataset = Dataset(DatasetMeta("self-cognition-dpo", split=split), skip_bad_rows=False)
    dataset.map(SelfCognitionDPOProcessor("Twinkle", "Acme"))
    assert len(dataset) == (120 if split == "train" else 30)
    first = dataset[0]["positive"]["messages"]
    assert "Twinkle" in first[-1]["content"] and "{{" not in json.dumps(dataset[0], ensure_ascii=False)


def test_an_unknown_split_of_the_bundled_pairs_is_one_line():
    with pytest.raises(
        UserError,
        match=r"^the bundled dataset self-cognition-dpo has no 'test' split; use split 'train' or 'eval'$",
    ):
        Dataset(DatasetMeta("self-cognition-dpo", split="test"))
