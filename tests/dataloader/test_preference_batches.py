"""Batches of preference pairs: ``batch_size`` counts pairs, each data-parallel rank gets whole
pair rows, which the model's processor collates as ``[pos_1, neg_1, pos_2, neg_2, ...]``."""

import math

import pytest
import torch

from twinkle.dataloader import DataLoader, collate, interleave_pairs
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.preprocessor import PreferenceProcessor
from twinkle.template.base import IGNORE_INDEX

PAIRS = 7


@pytest.fixture(scope="module")
def pairs(tiny_model_dir) -> Dataset:
    """Seven encoded pairs; pair ``i`` asks question ``i`` and its sides differ in length."""
    rows = [
        {
            "prompt": f"Question {i}?",
            "chosen": f"Answer {i}." * (1 + i % 3),
            "rejected": f"No {i}." * (3 - i % 3),
        }
        for i in range(PAIRS)
    ]
    dataset = Dataset(DatasetMeta(data=rows), skip_bad_rows=False)
    dataset.set_template("Template", model_id=str(tiny_model_dir), max_length=128)
    return dataset.map(PreferenceProcessor).encode()


def _rows_of(batch: dict[str, torch.Tensor]) -> list[tuple[list[int], list[int]]]:
    """Each row's unpadded ``(input_ids, labels)``."""
    out = []
    for ids, labels, mask in zip(batch["input_ids"], batch["labels"], batch["attention_mask"], strict=True):
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any()  # right padding
        assert (labels[n:] == IGNORE_INDEX).all()
        out.append((ids[:n].tolist(), labels[:n].tolist()))
    return out


def _sides(dataset: Dataset, index: int) -> list[tuple[list[int], list[int]]]:
    row = dataset[index]
    return [(row[s]["input_ids"], row[s]["labels"]) for s in ("positive", "negative")]


@pytest.mark.parametrize("batch_size", [2, 4, 6])
@pytest.mark.parametrize("shuffle", [False, True])
def test_two_ranks_get_whole_pairs_interleaved(pairs, batch_size, shuffle):
    loaders = [
        DataLoader(pairs, batch_size=batch_size, world_size=2, rank=rank, shuffle=shuffle, seed=3)
        for rank in (0, 1)
    ]
    assert len(loaders[0]) == math.ceil(PAIRS / batch_size)  # batch_size counts pairs
    order = loaders[0]._order()
    seen = []
    for step, (rows0, rows1) in enumerate(zip(*loaders, strict=True)):
        assert all("positive" in row and "negative" in row for row in rows0 + rows1)  # pair rows
        batch0, batch1 = (collate(r, pad_token_id=pairs.pad_token_id) for r in (rows0, rows1))
        global_pairs = order[step * batch_size : (step + 1) * batch_size]
        rows = _rows_of(batch0) + _rows_of(batch1)
        # each rank holds an even number of rows: whole pairs, positive then negative
        assert batch0["input_ids"].shape[0] % 2 == 0 and batch1["input_ids"].shape[0] % 2 == 0
        assert rows == [side for index in global_pairs for side in _sides(pairs, index)]
        # the ranks' shares differ by at most one pair (the last batch is short)
        shares = [batch0["input_ids"].shape[0] // 2, batch1["input_ids"].shape[0] // 2]
        assert sum(shares) == len(global_pairs) and abs(shares[0] - shares[1]) <= 1
        seen += global_pairs
    assert sorted(seen) == list(range(PAIRS))
    assert loaders[0].consumed == PAIRS  # consumed counts pairs too


def test_a_rank_without_a_pair_gets_an_empty_batch(pairs):
    batches = list(DataLoader(pairs, batch_size=2, world_size=2, rank=1))
    assert batches[-1] == []  # the last global batch holds one pair, on rank 0


def test_both_rows_of_a_pair_share_the_prompt(pairs):
    batch = next(iter(DataLoader(pairs, batch_size=4, world_size=1, rank=0)))
    rows = _rows_of(collate(batch, pad_token_id=pairs.pad_token_id))
    for pos, neg in zip(rows[::2], rows[1::2], strict=True):
        start = next(i for i, t in enumerate(pos[1]) if t != IGNORE_INDEX)
        assert start == next(i for i, t in enumerate(neg[1]) if t != IGNORE_INDEX)
        assert pos[0][:start] == neg[0][:start] and pos[0] != neg[0]


def test_interleave_pairs_is_upstreams_batch_order():
    rows = [
        {"positive": {"input_ids": [1]}, "negative": {"input_ids": [2]}, "length": 2, "id": "a"},
        {"positive": {"input_ids": [3]}, "negative": {"input_ids": [4]}, "length": 2, "id": "b"},
    ]
    assert interleave_pairs(rows) == [
        {"id": "a", "input_ids": [1]},
        {"id": "a", "input_ids": [2]},
        {"id": "b", "input_ids": [3]},
        {"id": "b", "input_ids": [4]},
    ]
    plain = [{"input_ids": [5], "labels": [5]}]
    assert interleave_pairs(plain) == plain


def test_the_model_takes_a_preference_batch(pairs, make_model):
    batch = collate([pairs[0], pairs[1]], pad_token_id=pairs.pad_token_id)
    assert batch["input_ids"].shape[0] == 4
    model = make_model()
    rows = next(iter(DataLoader(pairs, batch_size=2, world_size=1, rank=0)))
    as_rows = model.forward_only(inputs=rows, disable_lora=True)["logps"]
    assert torch.equal(as_rows, model.forward_only(inputs=batch, disable_lora=True)["logps"])
    assert as_rows.shape[0] == 4  # the model's processor laid the pairs out as their sides
    assert math.isfinite(model.forward_backward(inputs=batch))
