"""The contract script, unchanged, run with ``--report-to tensorboard``: ``metrics.jsonl``, the
TensorBoard event files, ``curves.png``, the summary line, plain progress lines off a
terminal, and a resumed run that appends with continuing steps. One shared pair of runs."""

import json
import os
import re
from pathlib import Path

import pytest
import torch
import warm
from tolerances import UNIT_ROUNDOFF

SCRIPT = Path(__file__).resolve().parents[2] / "cookbook" / "transformers" / "fsdp2.py"
FLAGS = ("--train-samples", "16", "--batch-size", "4", "--eval-samples", "4")
FLAGS += ("--eval-interval", "2", "--log-interval", "1", "--lr", "1e-2", "--report-to", "tensorboard")


def _run(tmp: Path, model_dir: Path, *flags: str) -> str:
    argv = [str(SCRIPT), "--model-id", str(model_dir), "--output-dir", str(tmp / "out"), *FLAGS, *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = warm.run(argv, cwd=tmp, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stderr


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    """A fresh run (4 steps), its records, then a run resumed from ``checkpoint-2``."""
    tmp = tmp_path_factory.mktemp("report")
    first_log = _run(tmp, tiny_model_dir)
    out = tmp / "out"
    first = _records(out)
    resumed_log = _run(tmp, tiny_model_dir, "--resume-from-checkpoint", str(out / "checkpoint-2"))
    return {
        "out": out,
        "first": first,
        "all": _records(out),
        "first_log": first_log,
        "resumed_log": resumed_log,
    }


def test_every_metric_call_is_one_json_line(runs):
    records = runs["first"]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert [r["step"] for r in evals] == [2, 4]
    for r in train:
        for key in ("loss", "lr", "grad_norm", "tokens_per_second", "peak_memory_mb", "time", "elapsed_s"):
            assert isinstance(r[key], int | float), (key, r)
    assert all(r["peak_memory_mb"] > 0 and "accuracy" in r for r in records)
    assert train[0]["time"] <= train[-1]["time"]
    # the numbers are those the script logged
    logged = [
        float(x)
        for x in re.findall(r"Current is step \d+ of \d+, metric: \{'loss': ([^,}]+)", runs["first_log"])
    ]
    assert logged == [r["loss"] for r in train]  # the same floats, printed and in JSON: both round-trip


def test_resume_appends_and_continues_the_steps(runs):
    first, records = runs["first"], runs["all"]
    assert records[: len(first)] == first
    after = [r["step"] for r in records[len(first) :] if r["kind"] == "train"]
    assert after == [3, 4]


def test_tensorboard_event_files_hold_the_scalars(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logs = runs["out"] / "tensorboard"
    assert list(logs.glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(logs))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"train/loss", "train/lr", "train/grad_norm", "eval/loss"} <= set(tags)
    steps = [e.step for e in acc.Scalars("train/loss")]
    assert sorted(set(steps)) == [1, 2, 3, 4]
    first_loss = [e.value for e in acc.Scalars("train/loss") if e.step == 1][0]
    # tensorboard keeps a scalar as fp32: the JSON's float64 rounded once, 2^-24 relative at most
    assert first_loss == pytest.approx(runs["first"][0]["loss"], rel=UNIT_ROUNDOFF[torch.float32], abs=0)


def test_summary_line_and_curves(runs):
    out = runs["out"]
    png = out / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    summary = [line for line in runs["first_log"].splitlines() if "run summary:" in line]
    assert len(summary) == 1, runs["first_log"][-3000:]
    best = min((r for r in runs["first"] if r["kind"] == "eval"), key=lambda r: r["loss"])
    assert f"best eval loss {best['loss']:.4f} at step {best['step']}" in summary[0]
    assert "4 steps" in summary[0] and "tokens/s" in summary[0] and "peak memory" in summary[0]
    assert str(out / f"checkpoint-{best['step']}") in summary[0]


def test_progress_off_a_terminal_rides_on_the_script_line(runs):
    log = runs["first_log"]
    assert "\r" not in log  # no bar redraws
    lines = [line for line in log.splitlines() if "Current is step" in line]
    assert len(lines) == 4
    assert all("| progress: step " in line and " eta " in line for line in lines), lines
    assert sum("progress:" in line for line in log.splitlines()) == 4  # one line per interval, not two
    assert "step 4/4 (100%)" in lines[-1]
