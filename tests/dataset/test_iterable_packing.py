"""``IterableDataset`` (a stream, encoded row by row) and ``PackingDataset`` (several samples
per row), on a tiny jsonl and the tiny model."""

import json
import random

import pytest
import torch
import torch.nn.functional as F
from tolerances import chain_tolerances, tiny_llama_sums

from twinkle.dataloader import DataLoader, collate
from twinkle.dataloader.collate import segment_starts
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.dataset.iterable import IterableDataset
from twinkle.dataset.packing import PackingDataset, pack_lengths
from twinkle.kernel.attention.packed import Segments, enable_segment_attention
from twinkle.model.forward import causal_lm_of
from twinkle.preprocessor import SelfCognitionProcessor
from twinkle.template.base import IGNORE_INDEX
from twinkle.utils.errors import UserError

ROWS = [
    {"query": f"Question {i}?" + " more" * (i % 5), "response": "Answer " * (1 + i % 4)} for i in range(12)
]


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("stream") / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS), encoding="utf-8")
    return str(path)


def _chain(dataset, model_dir):
    dataset.set_template("Template", model_id=str(model_dir), max_length=128)
    dataset.map(SelfCognitionProcessor("Twinkle", "Acme"))
    dataset.encode()
    return dataset


@pytest.fixture(scope="module")
def stream(jsonl, tiny_model_dir) -> IterableDataset:
    return _chain(IterableDataset(DatasetMeta(jsonl)), tiny_model_dir)


@pytest.fixture(scope="module")
def table(jsonl, tiny_model_dir) -> Dataset:
    return _chain(Dataset(DatasetMeta(jsonl)), tiny_model_dir)


def firsts(loader) -> list[list[int]]:
    """Each batch as the rows' token lists (a row names its sample)."""
    return [[tuple(row["input_ids"]) for row in batch] for batch in loader]


def test_stream_encodes_what_the_table_encodes(stream, table):
    samples = list(stream)
    assert [s["input_ids"] for s in samples] == [table[i]["input_ids"] for i in range(len(table))]
    assert [s["labels"] for s in samples] == [table[i]["labels"] for i in range(len(table))]
    with pytest.raises(TypeError):
        len(stream)
    raw = IterableDataset(stream.meta)
    assert next(raw) == ROWS[0] and next(raw) == ROWS[1]  # no map/encode: the rows as read


@pytest.mark.parametrize("rank", [0, 1])
def test_loader_over_a_stream_gives_the_tables_batches(stream, table, rank):
    from_stream = list(DataLoader(stream, 4, world_size=2, rank=rank))
    from_table = list(DataLoader(table, 4, world_size=2, rank=rank))
    assert len(from_stream) == len(from_table) == 3
    for a, b in zip(from_stream, from_table, strict=True):
        assert [row["input_ids"] for row in a] == [row["input_ids"] for row in b]
        assert [row["labels"] for row in a] == [row["labels"] for row in b]


def test_stream_shuffle_resume_and_workers(stream):
    def make(seed=3, **kw):
        return DataLoader(stream, 4, shuffle=True, seed=seed, shuffle_buffer=5, world_size=1, rank=0, **kw)

    full = firsts(make())
    in_order = firsts(DataLoader(stream, 4, world_size=1, rank=0))
    assert full == firsts(make()) and full != firsts(make(seed=4)) and full != in_order
    assert sorted(sum(full, [])) == sorted(sum(in_order, []))  # every sample once
    halves = [
        firsts(DataLoader(stream, 4, shuffle=True, seed=3, shuffle_buffer=5, world_size=2, rank=r))
        for r in (0, 1)
    ]
    assert [a + b for a, b in zip(*halves, strict=True)] == full  # the same order on every rank
    first = make()
    consumed = firsts([next(iter(first))])
    resumed = make()
    resumed.resume_from_checkpoint(first.get_state()["consumed_train_samples"])
    assert consumed + firsts(resumed) == full
    assert firsts(make(num_workers=2)) == full


def test_stream_slice_drop_last_and_raw_rows(jsonl):
    picked = IterableDataset(DatasetMeta(jsonl, data_slice=range(2, 9, 2)))
    assert list(DataLoader(picked, 2, world_size=1, rank=0)) == [[ROWS[2], ROWS[4]], [ROWS[6], ROWS[8]]]
    assert len(list(DataLoader(picked, 3, world_size=1, rank=0, drop_last=True))) == 1
    assert len(list(DataLoader(picked, 3, world_size=1, rank=0, min_batch_size=2))) == 1
    with pytest.raises(UserError, match="increasing order"):
        IterableDataset(DatasetMeta(jsonl, data_slice=[3, 1]))
    with pytest.raises(UserError, match="before dataset.encode"):
        IterableDataset(DatasetMeta(jsonl)).encode()


def test_pack_lengths_fills_rows_deterministically():
    assert pack_lengths([5, 5, 5, 5], 10) == [[0, 1], [2, 3]]
    assert pack_lengths([6, 4, 3, 7], 10) == [[0, 1], [2, 3]]  # 6+4 and 3+7, not 7, 6+3, 4
    assert pack_lengths([12, 3], 10) == [[0], [1]]  # too long for any row: a row of its own
    lengths = [random.Random(i).randint(1, 60) for i in range(300)]
    for window in (7, 1000):
        rows = pack_lengths(lengths, 100, window=window)
        assert rows == pack_lengths(lengths, 100, window=window)
        assert sorted(i for row in rows for i in row) == list(range(300))
        assert all(sum(lengths[i] for i in row) <= 100 for row in rows)
        assert len(rows) <= sum(lengths) / 100 * 1.1 + 1  # nearly every row full


@pytest.fixture(scope="module")
def packed(tiny_model_dir) -> PackingDataset:
    """The conftest ``dataset``'s twenty samples, packed into rows of at most 128 tokens."""
    dataset = PackingDataset(DatasetMeta(None, data_slice=range(20)))
    dataset.set_template("Template", model_id=str(tiny_model_dir), max_length=128)
    dataset.map(SelfCognitionProcessor("Twinkle", "Acme"))
    dataset.encode()
    return dataset.pack_dataset()


def test_packed_rows_hold_the_samples_end_to_end(packed, dataset):
    assert len(packed) < len(dataset)
    assert sorted(i for row in packed.packed_idx for i in row) == list(range(len(dataset)))
    for index, members in enumerate(packed.packed_idx):
        row = packed[index]
        assert len(row["input_ids"]) == row["length"] <= 128
        starts = segment_starts(row["position_ids"])
        assert len(starts) == len(members)
        for start, end, i in zip(starts, [*starts[1:], row["length"]], members, strict=True):
            sample = dataset[i]
            assert row["input_ids"][start:end] == sample["input_ids"]
            assert row["position_ids"][start:end] == list(range(end - start))
            assert row["labels"][start] == IGNORE_INDEX  # nothing predicts across the border
            assert row["labels"][start + 1 : end] == sample["labels"][1:]


def _token_losses(logits: torch.Tensor, labels: list[int]) -> torch.Tensor:
    """Each position's loss on the next label (0 where that label is ignored)."""
    targets = torch.tensor(labels[1:])
    losses = F.cross_entropy(logits[:-1].float(), targets.clamp(min=0), reduction="none")
    return losses * (targets != IGNORE_INDEX)


def test_packed_row_forward_gives_each_samples_loss(make_model, packed, dataset):
    lm = causal_lm_of(make_model(init_lora_weights=False).model).eval()
    assert enable_segment_attention(lm.config)
    index = max(range(len(packed)), key=lambda r: len(packed.packed_idx[r]))
    row, members = packed[index], packed.packed_idx[index]
    assert len(members) >= 2
    starts = segment_starts(row["position_ids"])
    ends = [*starts[1:], row["length"]]
    inputs = {
        "input_ids": torch.tensor([row["input_ids"]]),
        "position_ids": torch.tensor([row["position_ids"]]),
        "attention_mask": torch.ones(1, row["length"], dtype=torch.long),
    }
    segments = Segments(tuple(zip(starts, ends, strict=True)))
    # a sample in its packed row or alone: the same terms (a masked key adds exact zeros) in other
    # orders, within the first-order bound of the tiny Llama's chain of sums over the row
    # (tolerances.py, a few 1e-4 of the largest token loss); a key of another sample moves a loss
    # by a fraction of it
    sums = tiny_llama_sums(row["length"], vocab=600)
    with torch.no_grad():
        packed_losses = _token_losses(lm(**inputs, twinkle_segments=segments).logits[0], row["labels"])
        crossing = _token_losses(lm(**inputs).logits[0], row["labels"])  # one causal row
        for start, end, i in zip(starts, ends, members, strict=True):
            sample = dataset[i]
            alone = _token_losses(
                lm(input_ids=torch.tensor([sample["input_ids"]])).logits[0], sample["labels"]
            )
            torch.testing.assert_close(packed_losses[start : end - 1], alone, **chain_tolerances(sums, alone))
        assert packed_losses[ends[0] - 1] == 0  # the last token of a sample predicts nothing
    # without the segments the later samples see the earlier ones: their losses change by more
    # than the orders of the sums could
    later = packed_losses[starts[1] : ends[1] - 1]
    assert not torch.allclose(crossing[starts[1] : ends[1] - 1], later, **chain_tolerances(sums, later))


def model_loss_of_rows_is_the_batchs(make_model, rows, batch) -> bool:
    model = make_model(init_lora_weights=False)
    return model.forward_only(inputs=rows)["loss"] == model.forward_only(inputs=batch)["loss"]


def test_loader_over_packed_rows_gives_the_loss_of_its_samples(make_model, packed, dataset):
    rows = next(iter(DataLoader(packed, 2, world_size=1, rank=0)))
    members = [i for row in packed.packed_idx[:2] for i in row]
    batch = collate(rows, dataset.pad_token_id)  # what the model's processor makes of the rows
    expected = collate([dataset[i] for i in members], dataset.pad_token_id)
    assert all(torch.equal(batch[k], expected[k]) for k in expected)  # one row per sample
    assert model_loss_of_rows_is_the_batchs(make_model, rows, batch)
    model = make_model(init_lora_weights=False)
    loss = model.forward_only(inputs=batch)["loss"]
    alone = [model.forward_only(inputs=collate([dataset[i]], dataset.pad_token_id))["loss"] for i in members]
    tokens = [sum(t != IGNORE_INDEX for t in dataset[i]["labels"][1:]) for i in members]
    mean = sum(loss_i * n for loss_i, n in zip(alone, tokens, strict=True)) / sum(tokens)
    assert abs(loss - mean) < 1e-5


def test_reading_an_encoded_dataset_packs_it(jsonl, tiny_model_dir):
    dataset = PackingDataset(DatasetMeta(jsonl))
    assert len(dataset) == len(ROWS) and dataset[0] == ROWS[0]  # not encoded yet: the plain rows
    with pytest.raises(UserError, match="before dataset.pack_dataset"):
        dataset.pack_dataset()
    _chain(dataset, tiny_model_dir)
    assert 0 < len(dataset) < len(ROWS)  # packed on first read, without pack_dataset()
    assert sorted(i for row in dataset.packed_idx for i in row) == list(range(len(ROWS)))


def test_stream_of_rows_in_memory_and_a_generator_slice():
    stream = IterableDataset(DatasetMeta(data=ROWS[:5], data_slice=(i for i in (1, 3))))
    assert list(stream) == [ROWS[1], ROWS[3]]
    assert list(stream) == [ROWS[1], ROWS[3]]  # a second pass reads the same rows
