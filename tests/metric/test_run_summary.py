"""The end-of-run summary names the checkpoint that holds the best eval's weights: the folder a
save of that step went to (``on_save``, each adapter its own), else one under the output dir."""

import json
import shutil

import pytest
import torch

from twinkle.metric.report import RunReport
from twinkle.runtime import RunDefaults
from twinkle.utils.fileio import COMPLETE_MARKER

NONE = "no checkpoint saved at that step"


def new_report(output_dir) -> RunReport:
    return RunReport(RunDefaults(output_dir=str(output_dir), report_to=()), torch.device("cpu"))


def summary_after_evals(output_dir) -> str:
    report = new_report(output_dir)
    report.on_metrics({"loss": 1.0}, False, 2)
    report.on_metrics({"loss": 0.5}, False, 3)  # the best eval is the last step's
    line = report.summary()
    report.finish()
    assert "best eval loss 0.5000 at step 3" in line, line
    return line


def saved(folder, state: str, complete: bool = True) -> None:
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(state)
    if complete:
        (folder / COMPLETE_MARKER).write_text("{}")


def test_a_checkpoint_of_the_best_step_is_named(tmp_path):
    (tmp_path / "checkpoint-3").mkdir()
    assert f"({tmp_path / 'checkpoint-3'})" in summary_after_evals(tmp_path)


def test_the_last_checkpoint_is_named_when_it_holds_the_best_step(tmp_path):
    saved(tmp_path / "last-checkpoint", json.dumps({"cur_step": 3}))
    assert f"({tmp_path / 'last-checkpoint'})" in summary_after_evals(tmp_path)


@pytest.mark.parametrize(
    ("state", "complete"),
    [
        (json.dumps({"cur_step": 2}), True),  # saved at another step
        (json.dumps({"cur_step": 3}), False),  # no completion marker: not a checkpoint Twinkle finished
        ('{"cur_step": 3', True),  # cut short
        (json.dumps({"cur_step": "3"}), True),  # not a trainer state Twinkle writes
    ],
)
def test_no_checkpoint_is_named_when_none_holds_the_best_step(tmp_path, state, complete):
    saved(tmp_path / "last-checkpoint", state, complete)
    assert f"({NONE})" in summary_after_evals(tmp_path)


def test_no_folder_at_all(tmp_path):
    assert f"({NONE})" in summary_after_evals(tmp_path)


def test_each_adapter_gets_its_best_eval_and_the_folder_it_saved_then(tmp_path):
    report = new_report(tmp_path)
    for adapter, losses in {"twinkle": (0.9, 0.7), "pip": (0.4, 0.6)}.items():
        for step, loss in zip((2, 4), losses, strict=True):
            report.on_metrics({"loss": loss}, False, step, adapter)
            folder = tmp_path / adapter / f"checkpoint-{step}"
            saved(folder, json.dumps({"cur_step": step}))
            report.on_save(folder, step, adapter)
    line = report.summary()
    report.finish()
    assert (
        f"best eval loss twinkle 0.7000 at step 4 ({tmp_path / 'twinkle' / 'checkpoint-4'}) "
        f"and pip 0.4000 at step 2 ({tmp_path / 'pip' / 'checkpoint-2'})"
    ) in line, line


def test_a_folder_rotated_away_or_saved_again_later_is_not_named(tmp_path):
    report = new_report(tmp_path)
    report.on_metrics({"loss": 0.5}, False, 3)
    first, last = tmp_path / "a" / "checkpoint-3", tmp_path / "a" / "last-checkpoint"
    for folder in (first, last):
        saved(folder, json.dumps({"cur_step": 3}))
        report.on_save(folder, 3)
    assert f"({first})" in report.summary()
    shutil.rmtree(first)
    assert f"({last})" in report.summary()
    (last / "trainer_state.json").write_text(json.dumps({"cur_step": 5}))  # saved again, later
    report.on_save(last, 5)
    assert f"({NONE})" in report.summary()
    report.finish()
