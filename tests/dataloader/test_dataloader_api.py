"""DataLoader keywords of upstream Twinkle and torch: device_mesh, num_workers, sampler,
collate_fn, set_processor (by name too), min_batch_size, max_retries, raw rows, and the refused
ones."""

import logging

import pytest
import torch

from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.distributed import DeviceMesh
from twinkle.utils.errors import UserError

PAD = 0


class FakeDataset:
    """Row ``i`` has ``i % 3 + 1`` tokens, all ``100 + i``, so a token names its row."""

    pad_token_id = PAD

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        ids = [100 + i] * (i % 3 + 1)
        return {"input_ids": ids, "labels": [-100] + ids[1:]}


class FlakyDataset(FakeDataset):
    """Row 3 fails its first two reads; row 5 fails every read; row 7 is a user error."""

    def __init__(self, n: int):
        super().__init__(n)
        self.reads = {}

    def __getitem__(self, i: int) -> dict:
        self.reads[i] = self.reads.get(i, 0) + 1
        if i == 5 or (i == 3 and self.reads[i] <= 2):
            raise OSError(f"read of row {i} failed")
        if i == 7:
            raise UserError("row 7 is broken; fix it")
        return super().__getitem__(i)


class Unencoded(FakeDataset):
    def __getitem__(self, i: int) -> dict:
        return {"messages": [{"role": "user", "content": "hi"}]}


class Stream:
    """An iterable without len: rows 0..n-1."""

    pad_token_id = PAD

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return (FakeDataset(self.n)[i] for i in range(self.n))


def rows(batch: list[dict]) -> list[int]:
    assert isinstance(batch, list)  # this rank's rows
    return [row["input_ids"][0] - 100 for row in batch]


def passes(loader) -> list[list[int]]:
    return [rows(b) for b in loader]


def test_device_mesh_gives_the_data_rank(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    by_mesh = DataLoader(FakeDataset(10), 4, device_mesh=DeviceMesh(fsdp_size=2, dp_size=1))
    assert (by_mesh.world_size, by_mesh.rank) == (2, 1)
    assert (
        passes(by_mesh)
        == passes(DataLoader(FakeDataset(10), 4, world_size=2, rank=1))
        == [[2, 3], [6, 7], [9]]
    )
    monkeypatch.setenv("RANK", "3")
    assert passes(DataLoader(FakeDataset(8), 4, device_mesh=DeviceMesh(fsdp_size=2, dp_size=2))) == [[3], [7]]
    with pytest.raises(UserError, match="device_mesh= or world_size="):
        DataLoader(FakeDataset(8), 4, device_mesh=DeviceMesh(fsdp_size=2, dp_size=1), world_size=2, rank=0)


@pytest.mark.parametrize("shuffle", [False, True])
def test_num_workers_gives_the_batches_of_one_process(shuffle):
    def make(**kw):
        return DataLoader(FakeDataset(11), 4, shuffle=shuffle, world_size=2, rank=1, **kw)

    alone = list(make())
    rng = torch.get_rng_state()
    workers = list(make(num_workers=2))
    assert torch.equal(torch.get_rng_state(), rng)  # a pass leaves the run's random state alone
    assert len(alone) == len(workers) == 3
    assert alone == workers  # the same rows, in the same order
    resumed = make(num_workers=2, persistent_workers=True)
    resumed.resume_from_checkpoint(4)
    assert passes(resumed) == [rows(b) for b in alone[1:]]
    assert passes(resumed) == [rows(b) for b in alone]  # a second pass, same workers, from the start


def test_sampler_orders_the_pass():
    order = [9, 0, 8, 1, 7, 2, 6, 3, 5, 4]
    loader = DataLoader(FakeDataset(10), 4, world_size=1, rank=0, sampler=order)
    assert len(loader) == 3
    assert passes(loader) == [[9, 0, 8, 1], [7, 2, 6, 3], [5, 4]]
    sampler = torch.utils.data.SubsetRandomSampler([1, 2, 3], generator=torch.Generator().manual_seed(0))
    assert sorted(sum(passes(DataLoader(FakeDataset(10), 2, world_size=1, rank=0, sampler=sampler)), [])) == [
        1,
        2,
        3,
    ]
    with pytest.raises(UserError, match="shuffle"):
        DataLoader(FakeDataset(10), 2, world_size=1, rank=0, sampler=order, shuffle=True)
    distributed = torch.utils.data.DistributedSampler(FakeDataset(10), num_replicas=2, rank=0)
    with pytest.raises(UserError, match="DistributedSampler"):
        DataLoader(FakeDataset(10), 2, world_size=1, rank=0, sampler=distributed)


class Firsts:
    """A processor class: the first token of each row, times ``scale``."""

    def __init__(self, scale: int = 1):
        self.scale = scale

    def __call__(self, samples: list[dict]) -> list[int]:
        return [s["input_ids"][0] * self.scale for s in samples]


def test_collate_fn_and_set_processor():
    def firsts(samples):
        return [s["input_ids"][0] for s in samples]

    loader = DataLoader(FakeDataset(4), 2, world_size=1, rank=0, collate_fn=firsts)
    assert list(loader) == [[100, 101], [102, 103]]
    loader = DataLoader(FakeDataset(4), 2, world_size=1, rank=0)
    loader.set_processor(Firsts, scale=2)
    assert list(loader) == [[200, 202], [204, 206]]
    loader.set_processor(Firsts(3))
    assert list(loader)[0] == [300, 303]
    ruled = DataLoader(FakeDataset(4), 2, world_size=1, rank=0, collate_fn=firsts)
    ruled.set_processor(Firsts(3))
    assert list(ruled)[0] == [100, 101]  # collate_fn= wins
    with pytest.raises(UserError, match="keyword arguments go with a class"):
        loader.set_processor(Firsts(), scale=2)
    with pytest.raises(UserError, match="unknown processor 'Nope'; valid names: InputProcessor"):
        loader.set_processor("Nope")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_set_processor_by_name_collates_in_the_loader(num_workers):
    loader = DataLoader(FakeDataset(4), 2, world_size=1, rank=0, num_workers=num_workers)
    loader.set_processor("InputProcessor", padding_side="left")
    first = next(iter(loader))
    assert first["input_ids"].tolist() == [[PAD, 100], [101, 101]]  # the dataset's pad, on the left
    assert first["attention_mask"].tolist() == [[0, 1], [1, 1]]
    with pytest.raises(UserError, match="padding_side='middle'"):
        loader.set_processor("InputProcessor", padding_side="middle")


def test_rows_without_a_template_come_as_they_are():
    dataset = Dataset(DatasetMeta(None, data_slice=range(5)))  # the bundled rows, no template
    batches = list(DataLoader(dataset, 2, world_size=2, rank=1))
    assert [len(b) for b in batches] == [1, 1, 0]
    assert batches[0] == [dataset[1]] and set(batches[0][0]) >= {"query", "response"}
    assert list(DataLoader([{"a": 1}, {"a": 2}], 2, world_size=1, rank=0)) == [[{"a": 1}, {"a": 2}]]
    assert list(DataLoader(Unencoded(2), 2, world_size=1, rank=0))[0][0]["messages"]  # the model encodes them
    collated = DataLoader(Unencoded(2), 2, world_size=1, rank=0)
    collated.set_processor("InputProcessor")
    with pytest.raises(UserError, match="not encoded"):  # collating needs encoded rows
        list(collated)


def test_min_batch_size_ends_the_pass():
    loader = DataLoader(FakeDataset(10), 4, world_size=2, rank=0, min_batch_size=3)
    assert len(loader) == 2 and passes(loader) == [[0, 1], [4, 5]]
    assert len(DataLoader(FakeDataset(11), 4, world_size=2, rank=0, min_batch_size=3)) == 3
    with pytest.raises(UserError, match="min_batch_size"):
        DataLoader(FakeDataset(10), 4, world_size=2, rank=0, min_batch_size=5)


@pytest.fixture
def warnings_seen():
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("twinkle")
    logger.addHandler(handler)
    yield seen
    logger.removeHandler(handler)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_max_retries_retries_then_skips_a_row(warnings_seen, num_workers):
    loader = DataLoader(FlakyDataset(7), 4, world_size=1, rank=0, max_retries=2, num_workers=num_workers)
    assert passes(loader) == [[0, 1, 2, 3], [4, 6]]  # row 3 read at its third try, row 5 left out
    assert loader.skipped_samples == 1 and loader.get_state() == {"consumed_train_samples": 7}
    assert (
        len(warnings_seen) == 1 and "row 5 (OSError: read of row 5 failed) after 3 tries" in warnings_seen[0]
    )
    no_retry = DataLoader(FlakyDataset(7), 4, world_size=1, rank=0, max_retries=0, num_workers=num_workers)
    assert passes(no_retry) == [[0, 1, 2], [4, 6]] and no_retry.skipped_samples == 2


def test_a_user_error_in_a_row_is_not_retried():
    dataset = FlakyDataset(8)
    with pytest.raises(UserError, match="row 7 is broken"):
        list(DataLoader(dataset, 4, world_size=1, rank=0))
    assert dataset.reads[7] == 1


@pytest.mark.parametrize(
    ("keyword", "value"),
    [
        ("batch_sampler", [[0, 1]]),
        ("generator", torch.Generator()),
        ("in_order", False),
        ("pin_memory_device", "cuda"),
        ("prefetch_factor", 2),
        ("persistent_workers", True),
    ],
)
def test_keywords_that_cannot_be_honoured_are_named(keyword, value):
    with pytest.raises(UserError, match=keyword):
        DataLoader(FakeDataset(4), 2, world_size=1, rank=0, **{keyword: value})


def test_a_function_that_builds_the_dataset():
    assert passes(DataLoader(lambda: FakeDataset(4), 2, world_size=1, rank=0)) == [[0, 1], [2, 3]]


def test_a_stream_has_no_length_but_iterates():
    loader = DataLoader(Stream(5), 2, world_size=1, rank=0)
    with pytest.raises(UserError, match="no length"):
        len(loader)
    assert [rows(b) for b in list(loader)] == [[0, 1], [2, 3], [4]]  # list() survives the missing len
    assert passes(DataLoader(Stream(5), 2, world_size=1, rank=0, drop_last=True)) == [[0, 1], [2, 3]]
    with pytest.raises(UserError, match="sampler"):
        DataLoader(Stream(5), 2, world_size=1, rank=0, sampler=[0, 1])
