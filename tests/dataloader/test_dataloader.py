"""Tests for twinkle.dataloader: batches of rows, collate, per-rank slices, shuffle and resume.

Ranks are simulated by building one loader per ``rank`` with the same ``world_size``."""

import pytest
import torch

from twinkle.dataloader import DataLoader, collate
from twinkle.utils.errors import UserError

PAD = 0


class FakeDataset:
    """Row ``i`` has ``i % 4 + 1`` tokens, all equal to ``100 + i``, so a token names its row."""

    pad_token_id = PAD

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        ids = [100 + i] * (i % 4 + 1)
        return {"input_ids": ids, "labels": [-100] + ids[1:]}


def rows(batch: list[dict]) -> list[int]:
    """The dataset indices in a batch of rows (read from the first token of each row)."""
    assert isinstance(batch, list)  # the loader yields this rank's rows, as upstream's does
    return [row["input_ids"][0] - 100 for row in batch]


def loader(n=10, batch_size=4, world_size=1, rank=0, **kwargs) -> DataLoader:
    return DataLoader(FakeDataset(n), batch_size, world_size=world_size, rank=rank, **kwargs)


def global_batches(n=10, batch_size=4, world_size=1, **kwargs) -> list[list[int]]:
    """Each global batch as the concatenation of every rank's rows, rank 0 first."""
    per_rank = [list(loader(n, batch_size, world_size, r, **kwargs)) for r in range(world_size)]
    assert len({len(batches) for batches in per_rank}) == 1  # every rank steps the same number of times
    return [sum((rows(b) for b in step), []) for step in zip(*per_rank, strict=True)]


def test_len_with_and_without_drop_last():
    assert len(loader(10, 4)) == 3
    assert len(loader(10, 4, drop_last=True)) == 2
    assert len(loader(8, 4)) == len(loader(8, 4, drop_last=True)) == 2
    assert global_batches(10, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert global_batches(10, 4, drop_last=True) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_collate_pads_right_and_masks_padding():
    batch = collate([FakeDataset(3)[1], FakeDataset(3)[2], FakeDataset(3)[0]], pad_token_id=PAD)
    assert batch["input_ids"].tolist() == [[101, 101, PAD], [102, 102, 102], [100, PAD, PAD]]
    assert batch["labels"].tolist() == [[-100, 101, -100], [-100, 102, 102], [-100, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 0], [0, 1, 2], [0, 0, 0]]
    assert all(t.dtype == torch.long for t in batch.values())
    assert collate([], pad_token_id=PAD)["input_ids"].shape == (0, 0)


@pytest.mark.parametrize("shuffle", [False, True])
def test_two_ranks_split_each_global_batch_in_order(shuffle):
    one = global_batches(10, 4, shuffle=shuffle, seed=3)
    rank0, rank1 = ([rows(b) for b in loader(10, 4, 2, r, shuffle=shuffle, seed=3)] for r in (0, 1))
    assert [a + b for a, b in zip(rank0, rank1, strict=True)] == one  # rank 0's half first, in order
    assert all(not set(a) & set(b) for a, b in zip(rank0, rank1, strict=True))
    assert [len(a) for a in rank0] == [len(b) for b in rank1] == [2, 2, 1]  # last batch of 2: 1 each


def test_short_last_batch_is_split_as_evenly_as_possible():
    # 11 rows, global batch 4: the last batch has 3 rows -> 2 on rank 0, 1 on rank 1.
    rank0, rank1 = (list(loader(11, 4, 2, r)) for r in (0, 1))
    assert [rows(b) for b in rank0] == [[0, 1], [4, 5], [8, 9]]
    assert [rows(b) for b in rank1] == [[2, 3], [6, 7], [10]]
    # 9 rows: the last batch has 1 row, so rank 1 gets an empty batch but still steps.
    rank1 = list(loader(9, 4, 2, 1))
    assert len(rank1) == 3 and rank1[-1] == []


def test_shuffle_is_seeded_and_identical_across_ranks():
    first = global_batches(12, 4, shuffle=True, seed=7)
    assert first == global_batches(12, 4, shuffle=True, seed=7)
    assert first != global_batches(12, 4, shuffle=True, seed=8)
    assert first != global_batches(12, 4)
    assert sorted(sum(first, [])) == list(range(12))
    assert global_batches(12, 4, world_size=2, shuffle=True, seed=7) == first


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("shuffle", [False, True])
def test_resume_yields_exactly_the_remaining_batches(world_size, shuffle):
    n, batch_size, k = 11, 4, 2
    for rank in range(world_size):
        full = [rows(b) for b in loader(n, batch_size, world_size, rank, shuffle=shuffle)]

        first = loader(n, batch_size, world_size, rank, shuffle=shuffle)
        it = iter(first)
        consumed = [rows(next(it)) for _ in range(k)]
        state = first.get_state()
        assert state == {"consumed_train_samples": k * batch_size}  # global count, same on every rank

        resumed = loader(n, batch_size, world_size, rank, shuffle=shuffle)
        resumed.resume_from_checkpoint(state["consumed_train_samples"])
        rest = [rows(b) for b in resumed]
        assert consumed + rest == full
        assert resumed.get_state() == {"consumed_train_samples": n}


def test_state_dict_round_trip():
    first = loader(10, 2)
    it = iter(first)
    next(it), next(it)
    second = loader(10, 2)
    second.load_state_dict(first.state_dict())
    assert rows(next(iter(second))) == [4, 5]


def test_batch_size_not_divisible_by_world_size_is_an_error():
    with pytest.raises(UserError, match=r"--batch-size 3 .*divisible.* 2"):
        loader(10, 3, world_size=2, rank=0)
    with pytest.raises(UserError, match="at least 1"):
        loader(10, 0)


def test_resume_past_the_end_is_an_error():
    with pytest.raises(UserError, match="consumed 11 samples .* has 10"):
        loader(10, 2).resume_from_checkpoint(11)
    with pytest.raises(UserError):
        loader(10, 2).resume_from_checkpoint(-1)
    done = loader(10, 2)
    done.resume_from_checkpoint(10)  # resuming exactly at the end is a finished pass
    assert list(done) == []
