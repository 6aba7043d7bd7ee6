"""Bad rows a ``LazyDataset`` leaves out under ``skip_bad_rows`` are counted in the loader's own
process when torch workers read them: the dataset's ``skipped_rows`` after a pass is the same
with ``num_workers=2`` as with none, the batches too, and a second pass counts them again."""

import json

import pytest

from twinkle.dataloader import DataLoader
from twinkle.dataset import DatasetMeta, LazyDataset
from twinkle.preprocessor import SelfCognitionProcessor

BAD = (1, 4, 5, 8, 11)  # rows with an empty response: SelfCognitionProcessor's bad row
ROWS = [{"query": f"Question {i}?", "response": "" if i in BAD else f"Answer {i}."} for i in range(12)]


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return str(path)


def _dataset(jsonl):
    return LazyDataset(DatasetMeta(jsonl), skip_bad_rows=True).map(SelfCognitionProcessor("n", "a"))


def _pass(loader):
    return [[row["messages"][0]["content"] for row in batch] for batch in loader]


@pytest.mark.parametrize("persistent_workers", [False, True])
def test_the_loaders_process_counts_the_rows_workers_skipped(jsonl, persistent_workers):
    plain = _dataset(jsonl)
    expected = _pass(DataLoader(dataset=plain, batch_size=4))
    assert plain.skipped_rows == len(BAD)
    assert [len(b) for b in expected] == [3, 2, 2]  # the bad rows left out of their batches

    dataset = _dataset(jsonl)
    loader = DataLoader(dataset=dataset, batch_size=4, num_workers=2, persistent_workers=persistent_workers)
    assert _pass(loader) == expected
    assert dataset.skipped_rows == len(BAD)
    assert loader.skipped_samples == 0  # a skipped bad row is not a failed read
    assert _pass(loader) == expected  # a second pass reads (and skips) them again
    assert dataset.skipped_rows == 2 * len(BAD)


def test_a_resumed_pass_counts_only_the_rows_it_reads(jsonl):
    dataset = _dataset(jsonl)
    loader = DataLoader(dataset=dataset, batch_size=4, num_workers=2)
    loader.resume_from_checkpoint(8)  # the last batch: rows 8 to 11, two of them bad
    assert [len(b) for b in loader] == [2]
    assert dataset.skipped_rows == 2
