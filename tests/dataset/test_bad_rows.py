"""Data rows that cannot be trained on: one line naming the file, the line, the row and the
field; ``--skip-bad-rows`` drops them and says so in one line per step, never silently.

The kinds of bad row are checked in process on ``Dataset`` (load, ``map``, ``encode``); the
verbatim contract script runs twice: once stopping at a bad row, once skipping them."""

import json
import logging
import pickle
import re
from pathlib import Path

import pytest
from harness import assert_one_line_error, run_script

import twinkle
from twinkle.cli import CLI
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.preprocessor import MessagesProcessor, SelfCognitionProcessor
from twinkle.preprocessor.base import BadRow
from twinkle.utils.errors import UserError

GOOD = {"query": "Who are you?", "response": "I am {{NAME}}."}
FAST = ("--train-samples", "8", "--batch-size", "4", "--eval-samples", "4", "--eval-interval", "100")


@pytest.fixture
def twinkle_warnings(caplog):
    """Warnings of the ``twinkle`` logger (it does not propagate to the root logger)."""
    logger = logging.getLogger("twinkle")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING, logger="twinkle")
    yield caplog
    logger.removeHandler(caplog.handler)


def _jsonl(path: Path, rows: list) -> Path:
    """One row per line, with a blank line after the first (lines and rows then differ)."""
    lines = [json.dumps(row) for row in rows]
    path.write_text("\n".join(lines[:1] + [""] + lines[1:]) + "\n", encoding="utf-8")
    return path


def _self_cognition(path: Path, skip: bool | None = None, **meta) -> Dataset:
    dataset = Dataset(DatasetMeta(str(path), **meta), skip_bad_rows=skip)
    return dataset.map(SelfCognitionProcessor("Twinkle", "Acme"))


# row 1 of each file (line 3) is bad: (the row, regex of the rest of its message)
ROW_CASES = {
    "number-where-text": (
        {"query": 42, "response": "r"},
        r": 'query' is a number \(42\) where most rows hold text",
    ),
    "boolean-where-text": ({"query": True, "response": "r"}, r": 'query' is a boolean \(True\) where most"),
    "list-where-text": ({"query": ["a"], "response": "r"}, r": 'query' is a list where most rows hold text"),
    "null": ({"query": "q", "response": None}, r" has no text field\(s\) response \(it has query\)"),
    "missing": ({"query": "q"}, r" has no text field\(s\) response \(it has query\)"),
    "empty-string": ({"query": "q", "response": ""}, r": 'response' is empty; every row needs text in query"),
    "blank-string": ({"query": " \n", "response": "r"}, r": 'query' is empty"),
}


@pytest.mark.parametrize("case", list(ROW_CASES))
def test_a_bad_row_is_named_by_file_line_row_and_field(case, tmp_path):
    row, pattern = ROW_CASES[case]
    path = _jsonl(tmp_path / "rows.jsonl", [GOOD, row, GOOD])
    with pytest.raises(UserError) as info:
        _self_cognition(path)
    message = str(info.value)
    assert "\n" not in message
    assert re.match(re.escape(f"{path}:3: row 1") + pattern, message), message
    assert message.endswith(
        "; fix the row, or pass --skip-bad-rows (Dataset(skip_bad_rows=True)) to drop such rows"
    )


def test_numbers_in_every_row_are_named_by_the_preprocessor(tmp_path):
    path = _jsonl(tmp_path / "rows.jsonl", [{"query": 1, "response": "r"}, {"query": 2, "response": "r"}])
    with pytest.raises(UserError, match=re.escape(f"{path}:1: row 0: 'query' is a number (1), not text")):
        _self_cognition(path)


def test_the_row_is_the_files_row_whatever_data_slice_picks(tmp_path):
    path = _jsonl(tmp_path / "rows.jsonl", [GOOD, GOOD, {"query": "q", "response": ""}])
    with pytest.raises(UserError, match=re.escape(f"{path}:4: row 2: 'response' is empty")):
        _self_cognition(path, data_slice=[2, 0, 1])  # position 0 of the slice is the file's row 2


MESSAGE_CASES = {
    "unknown-role": (
        [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}],
        r"row 1: messages\[1\].role is 'bot'; each message needs a role in \('system', 'user', 'assistant'\)",
    ),
    "no-assistant-turn": (
        [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
        r"row 1: 'messages' has no assistant turn after the first message, so nothing is learnt",
    ),
    "empty-reply": (
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}],
        r"row 1: messages\[1\].content \(assistant\) is empty",
    ),
    "not-a-list": ("hi there", r"row 1: 'messages' is text where most rows hold a list"),
    "content-not-text": (
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 3}],
        r"row 1: 'messages\[1\].content' is a number \(3\) where most rows hold text",
    ),
}
CHAT = [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "I am Twinkle."}]


@pytest.mark.parametrize("case", list(MESSAGE_CASES))
def test_bad_messages_are_named_by_row_and_field(case):
    messages, pattern = MESSAGE_CASES[case]
    with pytest.raises(UserError, match=r"^DatasetMeta\(data=...\): " + pattern):
        Dataset(DatasetMeta(data=[{"messages": CHAT}, {"messages": messages}])).map(MessagesProcessor())


# rows given in Python may hold bytes (an image's PNG), which JSON cannot: (rows, regex of the error)
BYTES_CASES = {
    "number-where-bytes": (
        [{"a": b"x"}, {"a": 1}, {"a": b"y"}],
        r"row 1: 'a' is a number \(1\) where most rows hold bytes; fix the row",
    ),
    "bytes-where-number": (
        [{"a": 1}, {"a": b"x"}, {"a": 2}],
        r"row 1: 'a' is bytes where most rows hold a number",
    ),
    "bytes-where-object": (
        [{"a": {"k": 1}}, {"a": b"x"}],
        r"row 1: 'a' is bytes where most rows hold an object",
    ),
    "list-where-bytes": (
        [{"a": b"x"}, {"a": b"y"}, {"a": [1]}],
        r"row 2: 'a' is a list where most rows hold bytes",
    ),
    "bytes-in-a-list": (
        [{"a": [1]}, {"a": [b"x"]}, {"a": [2]}],
        r"row 1: 'a\[0\]' is bytes where most rows hold a number",
    ),
    # Arrow would store the text as bytes without a word (a picture's path as the path's bytes)
    "text-where-bytes": (
        [{"a": b"x"}, {"a": "pic.png"}, {"a": b"y"}],
        r"row 1: 'a' is text where most rows hold bytes",
    ),
    "bytes-where-text": (
        [{"image": {"path": "a.png"}}, {"image": {"path": b"\x89PNG"}}, {"image": {"path": "b.png"}}],
        r"row 1: 'image.path' is bytes where most rows hold text",
    ),
}


@pytest.mark.parametrize("case", list(BYTES_CASES))
def test_bytes_beside_another_type_are_named_by_row_and_field(case):
    rows, pattern = BYTES_CASES[case]
    with pytest.raises(UserError, match=r"^DatasetMeta\(data=...\): " + pattern) as info:
        Dataset(DatasetMeta(data=rows))
    assert "\n" not in str(info.value)


def test_skip_bad_rows_keeps_the_bytes_rows():
    dataset = Dataset(DatasetMeta(data=[{"a": b"x"}, {"a": 1}, {"a": b"y"}]), skip_bad_rows=True)
    assert [dataset[i]["a"] for i in range(len(dataset))] == [b"x", b"y"]


def test_a_row_with_nothing_to_learn_after_the_template(tiny_model_dir):
    """Rows given as messages, no preprocessor: an assistant turn that opens the conversation is
    never supervised, so the row would train on nothing."""
    opening = [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Hi."}]
    dataset = Dataset(DatasetMeta(data=[{"messages": CHAT}, {"messages": opening}]))
    dataset.set_template("Template", model_id=str(tiny_model_dir), max_length=128)
    with pytest.raises(
        UserError,
        match=r"^DatasetMeta\(data=...\): row 1: 'messages' leaves no token to learn after the template "
        r"\(Template\): no assistant reply is rendered after another turn; fix the row",
    ):
        dataset.encode()


def test_truncation_is_not_a_bad_row(tiny_model_dir, twinkle_warnings):
    long = [{"role": "user", "content": "Who are you? " * 40}, {"role": "assistant", "content": "Twinkle."}]
    dataset = Dataset(DatasetMeta(data=[{"messages": CHAT}, {"messages": long}]))
    dataset.set_template("Template", model_id=str(tiny_model_dir), max_length=24)
    assert len(dataset.encode()) == 1
    assert "1 of 2 samples dropped: no supervised token left after --max-length 24" in twinkle_warnings.text


# ---------------------------------------------------------------- --skip-bad-rows
def test_skip_bad_rows_drops_and_reports_every_step(tmp_path, tiny_model_dir, twinkle_warnings):
    rows = [GOOD, {"query": 7, "response": "r"}, GOOD, {"query": "q", "response": ""}, {"query": "q"}, GOOD]
    path = _jsonl(tmp_path / "rows.jsonl", rows)
    dataset = _self_cognition(path, skip=True, data_slice=range(6))
    dataset.set_template("Template", model_id=str(tiny_model_dir), max_length=128).encode()
    assert len(dataset) == 4  # 5 rows load, the slice repeats one, map drops 2
    lines = [r.getMessage() for r in twinkle_warnings.records if "--skip-bad-rows" in r.getMessage()]
    assert lines == [
        f"--skip-bad-rows: load dropped 1 of 6 rows; the first: {path}:3: row 1: 'query' is a number (7) "
        "where most rows hold text",
        f"--skip-bad-rows: map dropped 2 of 6 rows; the first: {path}:5: row 3: 'response' is empty; every "
        f"row needs text in query, response | {path}:6: row 4 has no text field(s) response (it has query); "
        "every row needs query, response",
    ]


def test_skip_bad_rows_in_encode_and_through_the_cache(tiny_model_dir, twinkle_warnings):
    opening = [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Hi."}]
    rows = [{"messages": CHAT}, {"messages": opening}, {"messages": CHAT}]

    def encoded(skip: bool) -> Dataset:
        dataset = Dataset(DatasetMeta(data=rows), skip_bad_rows=skip)
        dataset.set_template("Template", model_id=str(tiny_model_dir), max_length=128)
        return dataset.encode(load_from_cache_file=True, batched=False)

    assert len(encoded(True)) == 2
    assert (
        "--skip-bad-rows: encode dropped 1 of 3 rows; the first: DatasetMeta(data=...): row 1: 'messages' "
        "leaves no token to learn" in twinkle_warnings.text
    )
    # The cached rows were encoded skipping; without the flag the same rows are still an error.
    with pytest.raises(UserError, match=r"^DatasetMeta\(data=...\): row 1: 'messages' leaves no token"):
        encoded(False)


def test_every_row_bad_is_an_error_even_when_skipping(tmp_path):
    path = _jsonl(tmp_path / "rows.jsonl", [{"query": "q", "response": ""}, {"query": "q"}])
    with pytest.raises(
        UserError, match=r"every one of the 2 rows is bad, nothing is left to train on; the first: "
    ):
        _self_cognition(path, skip=True)


def test_bad_rows_found_by_worker_processes_are_named_too(tmp_path):
    path = _jsonl(tmp_path / "rows.jsonl", [GOOD, GOOD, {"query": "q", "response": ""}, GOOD])
    dataset = Dataset(DatasetMeta(str(path)))
    with pytest.raises(UserError, match=re.escape(f"{path}:4: row 2: 'response' is empty")):
        dataset.map(SelfCognitionProcessor("Twinkle", "Acme"), num_proc=2)
    copy = pickle.loads(pickle.dumps(BadRow(3, "query", ": 'query' is empty")))
    assert (copy.index, copy.field, str(copy)) == (3, "query", "row 3: 'query' is empty")


def test_the_flag_sets_the_dataset_default_and_stays_out_of_the_meta_args():
    args = CLI.from_args(["--skip-bad-rows", "--dataset-id", "d"], env={})
    assert args.dataset.skip_bad_rows and not Dataset().skip_bad_rows  # parsed, not yet applied
    twinkle.initialize()
    assert Dataset().skip_bad_rows
    assert args.get_dataset_args() == {"dataset_id": "d", "split": "train"}  # DatasetMeta(**...)
    assert Dataset(skip_bad_rows=False).skip_bad_rows is False  # the keyword wins
    CLI.from_args([], env={})
    twinkle.initialize()
    assert Dataset().skip_bad_rows is False


# ---------------------------------------------------------------- the contract script
@pytest.fixture(scope="module")
def bad_rows_file(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bad-rows")
    rows = [GOOD, {"query": 42, "response": "r"}, GOOD, {"query": "q", "response": ""}, {"query": "q"}, GOOD]
    return _jsonl(folder / "rows.jsonl", rows)


@pytest.mark.slow
def test_script_stops_at_a_bad_row_in_one_line(bad_rows_file, tmp_path, tiny_model_dir):
    result = run_script(tmp_path, tiny_model_dir, tmp_path / "out", *FAST, "--dataset-id", str(bad_rows_file))
    pattern = re.escape(
        f"{bad_rows_file}:3: row 1: 'query' is a number (42) where most rows hold text; fix the row"
    )
    assert_one_line_error(result, pattern + r".*--skip-bad-rows", tmp_path / "out")


@pytest.mark.slow
def test_script_skips_bad_rows_and_says_which(bad_rows_file, tmp_path, tiny_model_dir):
    result = run_script(
        tmp_path,
        tiny_model_dir,
        tmp_path / "out",
        *FAST,
        "--dataset-id",
        str(bad_rows_file),
        "--skip-bad-rows",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if "--skip-bad-rows" in line]
    assert any(
        "load dropped 1 of 6 rows; the first: " in line and ":3: row 1: 'query'" in line for line in lines
    )
    assert any(
        re.search(r"map dropped \d+ of 8 rows; the first: .*:5: row 3: 'response' is empty", x) for x in lines
    )
    assert (tmp_path / "out" / "last-checkpoint" / "adapter_model.safetensors").is_file()
