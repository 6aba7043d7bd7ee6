"""Folders Twinkle did not write are never replaced or rotated away.

A save builds its folder under a hidden temporary name and renames it into place only with its
completion marker, so a visible ``checkpoint-N`` or ``last-checkpoint`` without the marker is
someone else's: a save to that name fails in one line, leaving it as it was; a run refuses at
start-up an output dir whose ``last-checkpoint`` is one; rotation and ``auto`` leave it alone."""

import logging
import re
from pathlib import Path

import pytest

from twinkle.checkpoint import check_output_dir, complete_checkpoints, latest_checkpoint
from twinkle.cli import CLI
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger


def foreign(root: Path, name: str) -> Path:
    """A folder of the user's own: a file, a sub-folder, no marker."""
    folder = root / name
    (folder / "notes").mkdir(parents=True)
    (folder / "adapter_model.safetensors").write_bytes(b"the user's own bytes")
    (folder / "notes" / "todo.txt").write_text("keep me")
    return folder


def contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(name: Path) -> str:
    return rf"^{re.escape(str(name))} exists and was not written by Twinkle \(no \.twinkle-complete\); .*: move it away"


@pytest.mark.parametrize("name", ["checkpoint-0", "last-checkpoint", "my-run"])
def test_a_save_never_replaces_a_folder_twinkle_did_not_write(name, make_model, tmp_path):
    out = tmp_path / "out"
    folder = foreign(out, name)
    before = contents(folder)
    model = make_model()
    with pytest.raises(UserError, match=refused(folder)) as exc:
        model.save(name, output_dir=str(out), adapter_name="default")
    assert "\n" not in str(exc.value)
    assert contents(folder) == before
    assert sorted(p.name for p in out.iterdir()) == [name]  # no temporary folder left behind


def test_a_file_of_that_name_is_not_replaced_either(make_model, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoint-0").write_text("a file")
    with pytest.raises(UserError, match=refused(out / "checkpoint-0")):
        make_model().save(output_dir=str(out), adapter_name="default")
    assert (out / "checkpoint-0").read_text() == "a file"


def test_a_twinkle_checkpoint_is_still_replaced(make_model, tmp_path):
    out = tmp_path / "out"
    model = make_model()
    model.save("last-checkpoint", output_dir=str(out), adapter_name="default", consumed_train_samples=1)
    model.save("last-checkpoint", output_dir=str(out), adapter_name="default", consumed_train_samples=2)
    assert [p.name for p in complete_checkpoints(out)] == ["last-checkpoint"]


def test_rotation_and_auto_leave_foreign_folders_alone(make_model, tmp_path):
    out = tmp_path / "out"
    mine = foreign(out, "checkpoint-1")
    before = contents(mine)
    model = make_model()
    for name in ("checkpoint-0", "checkpoint-2", "checkpoint-3"):
        model.save(name, output_dir=str(out), adapter_name="default", save_total_limit=1)
    assert contents(mine) == before
    assert latest_checkpoint(out) == out / "checkpoint-3"


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_start_up_refuses_a_foreign_last_checkpoint_and_warns_about_others(tmp_path):
    out = tmp_path / "out"
    other = foreign(out, "checkpoint-7")
    handler = _Warnings()
    get_logger().addHandler(handler)
    try:
        check_output_dir(out)
    finally:
        get_logger().removeHandler(handler)
    assert any(line.startswith(f"{other} has no .twinkle-complete") for line in handler.lines), handler.lines
    last = foreign(out, "last-checkpoint")
    before = contents(last)
    argv = ["--output-dir", str(out), "--resume-from-checkpoint", "auto"]
    with pytest.raises(UserError, match=refused(last)) as exc:
        CLI.from_args(argv, env={})
    assert "\n" not in str(exc.value)
    assert contents(last) == before
