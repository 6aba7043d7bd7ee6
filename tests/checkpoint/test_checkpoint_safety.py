"""Checkpoints are complete or absent: what ``auto`` resumes from, and saves that fail midway."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from twinkle.checkpoint import is_complete, latest_checkpoint, read_trainer_state
from twinkle.cli import CLI


def fake_checkpoint(root: Path, name: str, step: int, complete: bool = True) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"cur_step": step}))
    if complete:
        (folder / ".twinkle-complete").write_text("complete\n")
    return folder


def test_latest_skips_torn_and_in_progress_folders(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    fake_checkpoint(tmp_path, "checkpoint-4", 4)
    fake_checkpoint(tmp_path, "checkpoint-10", 10)  # more steps, though it sorts first by name
    fake_checkpoint(tmp_path, "checkpoint-12", 12, complete=False)  # its save was interrupted
    fake_checkpoint(tmp_path, ".checkpoint-14.tmp", 14)  # a save in progress
    (tmp_path / "checkpoint-16").mkdir()  # not a checkpoint at all
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-10"


@pytest.mark.parametrize("word", ["auto", "latest"])
def test_resume_auto_resolves_in_the_cli(tmp_path, word):
    out = tmp_path / "out"
    argv = ["--output-dir", str(out), "--resume-from-checkpoint", word]
    assert CLI.from_args(argv, env={}).training.resume_from_checkpoint is None  # nothing yet: fresh
    fake_checkpoint(out, "checkpoint-2", 2)
    fake_checkpoint(out, "checkpoint-3", 3, complete=False)
    assert CLI.from_args(argv, env={}).training.resume_from_checkpoint == str(out / "checkpoint-2")


def test_failed_save_of_any_kind_leaves_no_folder(make_model, tmp_path, monkeypatch):
    """Not only a full disk: whatever breaks a save, no half-written folder stays behind."""
    model = make_model()

    def broken(obj, f, *args, **kwargs):
        raise RuntimeError("serialiser bug")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(RuntimeError, match="serialiser bug"):
        model.save("ck", output_dir=str(tmp_path / "out"), adapter_name="default")
    assert list((tmp_path / "out").iterdir()) == []


def test_a_save_replaces_a_folder_only_when_complete(make_model, tmp_path):
    model = make_model()
    out = tmp_path / "out"
    first = model.save("ck", output_dir=str(out), adapter_name="default", consumed_train_samples=1)
    assert is_complete(first) and read_trainer_state(first)["consumed_train_samples"] == 1
    # A save killed before its rename leaves only a hidden temporary folder, which the next
    # save of that name clears away.
    shutil.copytree(first, out / ".ck.tmp")
    (out / ".ck.tmp" / ".twinkle-complete").unlink()
    model.save("ck", output_dir=str(out), adapter_name="default", consumed_train_samples=2)
    assert sorted(p.name for p in out.iterdir()) == ["ck"]
    assert read_trainer_state(out / "ck")["consumed_train_samples"] == 2
