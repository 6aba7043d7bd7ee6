"""Upstream's preprocessor and dataset call shapes: a ``Preprocessor`` subclass called with a
batch of rows as columns, ``DataFilter``, ``map``/``filter`` by name and by class with
``init_args``, ``batched=``/``load_from_cache_file=``, a local path with a subset name."""

import json
import logging

import pytest

from twinkle.data_format import Message, Trajectory
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.preprocessor import DataFilter, Preprocessor, SelfCognitionProcessor
from twinkle.utils.errors import UserError

ROWS = [{"q": f"question {i}", "a": f"answer {i}", "keep": i % 2 == 0} for i in range(6)]


class QAProcessor(Preprocessor):
    """Written as upstream's cookbooks write their processors: columns in, columns out."""

    def __init__(self, system: str = "Be brief."):
        self.system = system

    def __call__(self, rows):
        rows = self.map_col_to_row(rows)
        rows = [self.preprocess(row) for row in rows]
        return self.map_row_to_col(rows)

    def preprocess(self, row):
        messages = [
            Message(role="system", content=self.system),
            Message(role="user", content=row["q"]),
            Message(role="assistant", content=row["a"]),
        ]
        return Trajectory(messages=messages)


class KeepFlagged(DataFilter):
    def __call__(self, row):
        return row["keep"]


def _contents(dataset):
    return [[m["content"] for m in dataset[i]["messages"]] for i in range(len(dataset))]


@pytest.mark.parametrize("batched", [True, False])
def test_a_columns_preprocessor_maps_every_row(batched):
    dataset = Dataset(DatasetMeta(data=ROWS)).map(
        QAProcessor, init_args={"system": "S"}, batched=batched, batch_size=4
    )
    assert dataset.data.column_names == ["messages"]  # its output replaces the raw columns
    assert _contents(dataset) == [["S", r["q"], r["a"]] for r in ROWS]


def test_the_helpers_convert_both_ways():
    columns = {"a": [1, 2], "b": ["x", "y"]}
    rows = Preprocessor.map_col_to_row(columns)
    assert rows == [{"a": 1, "b": "x"}, {"a": 2, "b": "y"}]
    assert Preprocessor.map_row_to_col(rows) == columns
    assert Preprocessor.map_row_to_col([{"a": 1}, {"b": 2}]) == {"a": [1, None], "b": [None, 2]}
    assert Preprocessor.map_row_to_col([], keys=["a"]) == {"a": []}
    with pytest.raises(UserError, match="columns of different lengths"):
        Preprocessor.map_col_to_row({"a": [1], "b": [1, 2]})


def test_a_builtin_processor_takes_columns_too():
    out = SelfCognitionProcessor("Twinkle", "Acme")(
        {"query": ["Who?", "Hi"], "response": ["{{NAME}}", "{{AUTHOR}}"]}
    )
    assert [m[-1]["content"] for m in out["messages"]] == ["Twinkle", "Acme"]
    one = SelfCognitionProcessor("Twinkle", "Acme")
    assert one({"query": "Who?", "response": "{{NAME}}"}, 0)["messages"][-1]["content"] == "Twinkle"
    with pytest.raises(UserError, match=r"called with columns .*, got a row; call preprocess\(row\)"):
        one({"query": "Who?", "response": "{{NAME}}"})


def test_map_by_name_and_class_with_init_args_agree():
    rows = [{"query": "Who are you?", "response": "I am {{NAME}} by {{AUTHOR}}."}]
    args = {"model_name": "Twinkle", "model_author": "Acme"}
    by_name = Dataset(DatasetMeta(data=rows)).map("SelfCognitionProcessor", init_args=args)
    by_class = Dataset(DatasetMeta(data=rows)).map(SelfCognitionProcessor, init_args=args)
    assert _contents(by_name) == _contents(by_class)
    assert _contents(by_name)[0][-1] == "I am Twinkle by Acme."
    with pytest.raises(
        UserError, match="unknown Preprocessor 'SelfCognition'; valid names: .*SelfCognitionProcessor"
    ):
        Dataset(DatasetMeta(data=rows)).map("SelfCognition")


def test_a_data_filter_keeps_what_it_returns_true_for():
    kept = Dataset(DatasetMeta(data=ROWS)).filter(KeepFlagged)
    assert [row["q"] for row in kept.data] == [r["q"] for r in ROWS if r["keep"]]
    assert len(Dataset(DatasetMeta(data=ROWS)).filter(KeepFlagged())) == 3
    with pytest.raises(UserError, match="unknown DataFilter 'KeepFlagged'"):
        Dataset(DatasetMeta(data=ROWS)).filter("KeepFlagged")  # not one of twinkle.preprocessor's


def test_load_from_cache_file_in_map_is_said_not_swallowed(caplog):
    with caplog.at_level(logging.INFO, logger="twinkle"):
        dataset = Dataset(DatasetMeta(data=ROWS)).map(QAProcessor(), load_from_cache_file=True)
    assert len(dataset) == len(ROWS)
    assert any("load_from_cache_file=True" in r.getMessage() for r in caplog.records)
    with pytest.raises(UserError, match="Dataset.map: not supported yet: desc"):
        Dataset(DatasetMeta(data=ROWS)).map(QAProcessor(), desc="x")


def test_a_bad_row_from_a_builtin_is_still_named(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(
        "".join(
            json.dumps(r) + "\n" for r in [{"query": "a", "response": "b"}, {"query": "", "response": "c"}]
        )
    )
    with pytest.raises(UserError, match=r"rows.jsonl:2: row 1: 'query' is empty") as caught:
        Dataset(DatasetMeta(str(path))).map(SelfCognitionProcessor("n", "a"), batched=True)
    assert "\n" not in str(caught.value)
    skipped = Dataset(DatasetMeta(str(path)), skip_bad_rows=True).map(SelfCognitionProcessor("n", "a"))
    assert len(skipped) == 1


@pytest.mark.parametrize("as_folder", [False, True])
def test_a_local_path_with_a_subset_name_is_read_whole(tmp_path, as_folder):
    folder = tmp_path / "gsm8k"
    folder.mkdir()
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    dataset_id = str(folder if as_folder else path)
    dataset = Dataset(DatasetMeta(dataset_id, subset_name="main", split="train"))
    assert [row["q"] for row in dataset.data] == [r["q"] for r in ROWS]
