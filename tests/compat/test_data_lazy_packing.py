"""``twinkle.dataset.LazyDataset`` (rows preprocessed and encoded when read) and
``IterablePackingDataset`` (a stream packed as it is read), as upstream's scripts build them."""

import json

import pytest

from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta, IterablePackingDataset, LazyDataset
from twinkle.preprocessor import SelfCognitionProcessor
from twinkle.processor import collate
from twinkle.utils.errors import UserError

ROWS = [
    {"query": f"Question {i}?" + " more" * (i % 4), "response": "Answer " * (1 + i % 3)} for i in range(10)
]


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return str(path)


def _chain(dataset, model_dir, max_length=128):
    dataset.set_template("Template", model_id=str(model_dir), max_length=max_length)
    dataset.map(SelfCognitionProcessor, init_args={"model_name": "Twinkle", "model_author": "Acme"})
    dataset.encode()
    return dataset


def test_lazy_rows_equal_the_eager_rows(jsonl, tiny_model_dir):
    eager = _chain(Dataset(DatasetMeta(jsonl)), tiny_model_dir)
    lazy = _chain(LazyDataset(dataset_meta=DatasetMeta(jsonl)), tiny_model_dir)
    assert len(lazy) == len(eager)
    assert "messages" not in lazy.data.column_names  # nothing ran ahead: the raw rows are kept
    for i in range(len(eager)):
        assert {k: lazy[i][k] for k in ("input_ids", "labels")} == {
            k: eager[i][k] for k in ("input_ids", "labels")
        }
    from_loader = list(DataLoader(dataset=lazy, batch_size=4, num_workers=2))
    assert [r["input_ids"] for batch in from_loader for r in batch] == [
        eager[i]["input_ids"] for i in range(len(eager))
    ]


def test_lazy_bad_rows_and_order_of_calls(tmp_path, tiny_model_dir):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps({"query": "q", "response": ""}) + "\n")
    lazy = LazyDataset(DatasetMeta(str(path)))
    lazy.map(SelfCognitionProcessor("n", "a"))
    assert lazy[0]["messages"][1]["content"] == ROWS[0]["query"]
    with pytest.raises(UserError, match=r"bad.jsonl:2: row 1: 'response' is empty"):
        lazy[1]
    skipping = LazyDataset(DatasetMeta(str(path)), skip_bad_rows=True).map(SelfCognitionProcessor("n", "a"))
    assert skipping[1] is None and skipping.skipped_rows == 1
    with pytest.raises(UserError, match="call filter\\(\\) before map\\(\\)"):
        lazy.filter(lambda row: True)
    with pytest.raises(UserError, match="not supported yet: batched"):
        lazy.map(SelfCognitionProcessor("n", "a"), batched=True)


def test_iterable_packing_packs_the_stream_into_rows(jsonl, tiny_model_dir):
    table = _chain(Dataset(DatasetMeta(jsonl)), tiny_model_dir)
    packing = _chain(
        IterablePackingDataset(DatasetMeta(jsonl), packing_interval=4), tiny_model_dir, max_length=256
    )
    rows = list(packing.pack_dataset())
    assert 0 < len(rows) < len(ROWS) and all(len(r["input_ids"]) <= 256 for r in rows)
    samples = collate(rows, table.pad_token_id)  # the processor gives each packed sample its row
    lengths = sorted(int(n) for n in samples["attention_mask"].sum(1))
    assert lengths == sorted(len(table[i]["input_ids"]) for i in range(len(table)))
    batches = list(DataLoader(dataset=packing, batch_size=2))
    assert [r["input_ids"] for b in batches for r in b] == [r["input_ids"] for r in rows]
    cyclic = _chain(IterablePackingDataset(DatasetMeta(jsonl), cyclic=True), tiny_model_dir)
    first = [r for _, r in zip(range(2 * len(rows) + 1), cyclic, strict=False)]
    assert len(first) == 2 * len(rows) + 1  # it starts again at the end of the stream
    with pytest.raises(UserError, match="before dataset.pack_dataset"):
        IterablePackingDataset(DatasetMeta(jsonl)).pack_dataset()


def test_lazy_subsets_mapped_then_mixed_keep_their_own_maps(tmp_path):
    """Upstream's order: each subset mapped with its own preprocessor, then mixed; a read runs the
    row's own subset's maps and names its own file and line when it is bad."""
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("".join(json.dumps({"text": f"a{i}"}) + "\n" for i in range(3)))
    second.write_text("".join(json.dumps(r) + "\n" for r in [*ROWS[:2], {"query": "q", "response": ""}]))
    a, b = DatasetMeta(str(first)), DatasetMeta(str(second))

    def build():
        lazy = LazyDataset(a).add_dataset(b)
        lazy.map(lambda row: {"out": "A:" + row["text"]}, dataset_meta=a)
        return lazy.map(SelfCognitionProcessor("n", "x"), dataset_meta=b)

    lazy = build().mix_dataset(interleave=False)
    assert [lazy[i]["out"] for i in range(3)] == ["A:a0", "A:a1", "A:a2"]
    assert [lazy[i]["messages"][1]["content"] for i in (3, 4)] == [ROWS[0]["query"], ROWS[1]["query"]]
    assert not any(k.startswith("_twinkle") for k in lazy[3])
    with pytest.raises(UserError, match=r"b.jsonl:3: row 2: 'response' is empty"):
        lazy[5]
    mixed = build().mix_dataset(interleave=True, stopping_strategy="all_exhausted")
    reads = [mixed[i] for i in range(2)]
    assert reads[0]["out"] == "A:a0" and reads[1]["messages"][1]["content"] == ROWS[0]["query"]
    with pytest.raises(UserError, match="a second time"):
        mixed.add_dataset(DatasetMeta(str(first))).map(lambda row: row).mix_dataset()
