"""``--report-to``: parsing, the one-line error for a missing library, a wandb run through a
fake module, and the progress bar on a terminal."""

import io
import logging
import sys
import types

import pytest

from twinkle.cli import CLI
from twinkle.metric import sinks
from twinkle.metric.progress import Progress
from twinkle.metric.report import RunReport
from twinkle.runtime import RunDefaults
from twinkle.utils.errors import UserError


def test_names_and_comma_lists(tmp_path):
    assert sinks.parse_report_to("none") == ()
    assert sinks.parse_report_to("") == ()
    assert sinks.parse_report_to("tensorboard, TensorBoard") == ("tensorboard",)
    with pytest.raises(UserError, match="unknown mlflow; valid names: none, tensorboard, wandb, swanlab"):
        sinks.parse_report_to("tensorboard,mlflow")
    args = CLI.from_args(["--report-to", "tensorboard", "--output-dir", str(tmp_path / "o")], env={})
    assert args.training.report_to == "tensorboard"


def test_a_missing_library_is_one_line_naming_pip(monkeypatch, tmp_path):
    real = sinks.importlib.util.find_spec
    monkeypatch.setattr(sinks.importlib.util, "find_spec", lambda n: None if n == "swanlab" else real(n))
    with pytest.raises(UserError) as err:
        CLI.from_args(["--report-to", "tensorboard,swanlab", "--output-dir", str(tmp_path / "o")], env={})
    message = str(err.value)
    assert "\n" not in message and "pip install 'twinkle[swanlab]'" in message


class _FakeRun:
    def __init__(self, calls):
        self.calls = calls

    def log(self, values, step):
        self.calls.append(("log", values, step))

    def finish(self):
        self.calls.append(("finish",))


def test_wandb_runs_offline_without_a_key(monkeypatch, tmp_path):
    import torch

    calls = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or _FakeRun(calls)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(sinks.importlib.util, "find_spec", lambda n: object())
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    names = sinks.parse_report_to("wandb")
    defaults = RunDefaults(
        output_dir=str(tmp_path), report_to=names, run_args={"training": {"batch_size": 4}}
    )
    report = RunReport(defaults, torch.device("cpu"))
    report.on_backward(1, 2)
    report.on_metrics({"loss": 1.5, "lr": 1e-3, "step": 1, "tokens": 10}, True, 1)
    report.on_metrics({"loss": 1.25, "accuracy": 0.5}, False, 1)
    report.finish()
    assert calls[0][0] == "init" and calls[0][1]["mode"] == "offline"
    assert calls[0][1]["config"] == {"training": {"batch_size": 4}}
    logged = [c for c in calls if c[0] == "log"]
    assert logged[0][1]["train/loss"] == 1.5 and logged[0][2] == 1
    assert logged[1][1]["eval/loss"] == 1.25
    assert calls[-1] == ("finish",)
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 2
    assert (tmp_path / "curves.png").is_file()


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_terminal_gets_a_bar_with_loss_and_log_lines_above_it():
    stream = _Terminal()
    logger = logging.getLogger("twinkle.test_progress")
    logger.handlers[:] = [logging.StreamHandler(stream)]
    logger.propagate = False
    progress = Progress(logger, stream=stream)
    for step in (1, 2, 3):
        progress.step(step, 10)
    progress.metrics({"loss": 0.75, "tokens_per_second": 1234.0})
    logger.warning("a line during training")
    progress.step(4, 10)
    progress.close()
    text = stream.getvalue()
    assert "\r" in text and "4/10" in text and "loss=0.7500" in text and "1,234" in text
    assert "a line during training\n" in text
    assert "progress:" not in text  # no plain lines on a terminal
