"""``save_total_limit`` rotation never deletes the newest complete, the best, or a kept checkpoint."""

import json
from pathlib import Path

import pytest

from twinkle.checkpoint import best_checkpoint, latest_checkpoint, rotate_checkpoints
from twinkle.utils.errors import UserError


def fake_checkpoint(
    root: Path, name: str, step: int, metric: float | None = None, complete: bool = True
) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"cur_step": step, "metric": metric}))
    if complete:
        (folder / ".twinkle-complete").write_text("complete\n")
    return folder


def names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_keeps_the_newest_by_step_not_by_name(tmp_path):
    for step in (2, 9, 10, 11):
        fake_checkpoint(tmp_path, f"checkpoint-{step}", step)
    fake_checkpoint(tmp_path, "last-checkpoint", 12)
    fake_checkpoint(tmp_path, "checkpoint-1", 1, complete=False)  # torn: neither counted nor deleted
    (tmp_path / "notes").mkdir()
    deleted = rotate_checkpoints(tmp_path, 2)
    assert [p.name for p in deleted] == ["checkpoint-2", "checkpoint-9"]
    assert names(tmp_path) == ["checkpoint-1", "checkpoint-10", "checkpoint-11", "last-checkpoint", "notes"]


def test_never_deletes_the_best(tmp_path):
    fake_checkpoint(tmp_path, "checkpoint-1", 1, metric=0.5)  # the best: oldest, lowest eval loss
    fake_checkpoint(tmp_path, "checkpoint-2", 2, metric=0.9)
    fake_checkpoint(tmp_path, "checkpoint-3", 3, metric=0.8)
    fake_checkpoint(tmp_path, "checkpoint-4", 4, metric=float("nan"))  # the newest
    assert best_checkpoint(tmp_path).name == "checkpoint-1"
    rotate_checkpoints(tmp_path, 1)
    assert names(tmp_path) == ["checkpoint-1", "checkpoint-4"]  # one over the limit, on purpose


def test_keep_by_name(tmp_path):
    for step in (1, 2, 3):
        fake_checkpoint(tmp_path, f"checkpoint-{step}", step)
    rotate_checkpoints(tmp_path, 1, keep=["checkpoint-1"])
    assert names(tmp_path) == ["checkpoint-1", "checkpoint-3"]


def test_nothing_to_do_and_bad_limit(tmp_path):
    assert rotate_checkpoints(tmp_path / "missing", 1) == []
    fake_checkpoint(tmp_path, "checkpoint-1", 1)
    assert rotate_checkpoints(tmp_path, 1) == []
    with pytest.raises(UserError, match="save_total_limit must be at least 1"):
        rotate_checkpoints(tmp_path, 0)


def test_model_save_rotates_and_resume_auto_still_finds_the_newest(make_model, tmp_path):
    model = make_model()
    out = tmp_path / "out"
    losses = {1: 2.0, 2: 1.0, 3: 1.5, 4: 1.7}  # step 2 is the best
    group = model.optimizer_group["default"]
    for step, loss in losses.items():
        group.cur_step = step  # the counter the checkpoints are ordered by
        model.save(
            f"checkpoint-{step}", output_dir=str(out), adapter_name="default", save_total_limit=2, metric=loss
        )
    group.cur_step = 5
    model.save("last-checkpoint", output_dir=str(out), adapter_name="default", save_total_limit=1)
    assert names(out) == ["checkpoint-2", "checkpoint-4", "last-checkpoint"]
    assert json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["metric"] == 1.0
    assert latest_checkpoint(out).name == "last-checkpoint"
    with pytest.raises(UserError, match="save_total_limit must be at least 1"):
        model.save("checkpoint-5", output_dir=str(out), adapter_name="default", save_total_limit=0)
    assert not (out / "checkpoint-5").exists()
