"""The contract script ``cookbook/transformers/fsdp2.py``, run verbatim on the tiny model."""

import json
import os
import re
from pathlib import Path

import pytest
import warm

SCRIPT = Path(__file__).resolve().parents[2] / "cookbook" / "transformers" / "fsdp2.py"
LOSS = re.compile(r"Current is step (\d+) of \d+, metric: \{.*?'loss': ([^,}]+)")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", ".twinkle-complete")


def run_script(tmp_path: Path, model_dir: Path, *flags: str, env: dict | None = None, fresh=False) -> str:
    """Run the script in its own process from ``tmp_path``; return its stderr (the log).
    ``fresh``: a new interpreter; otherwise forked from one that has imported torch and peft
    (``tests/assets/warm.py``: the same run without ~10 s of imports)."""
    argv = [str(SCRIPT), "--model-id", str(model_dir), "--output-dir", str(tmp_path / "out"), *flags]
    # One thread: the tiny model is overhead-bound, and two OpenMP threads on two shared cores
    # spin against other processes (a step becomes up to 100x slower). No network: offline tests.
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    result = warm.run(argv, cwd=tmp_path, env=full_env, timeout=300, fresh=fresh)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stderr


def logged_losses(log: str) -> list[tuple[int, float]]:
    return [(int(step), float(loss)) for step, loss in LOSS.findall(log)]


def assert_checkpoint(folder: Path, consumed: int | None = None) -> None:
    for name in ADAPTER_FILES:
        assert (folder / name).is_file(), f"{folder / name} is missing"
    if consumed is not None:
        assert json.loads((folder / "trainer_state.json").read_text())["consumed_train_samples"] == consumed


@pytest.mark.slow
def test_script_trains_evaluates_and_saves(tmp_path, tiny_model_dir):
    log = run_script(
        tmp_path,
        tiny_model_dir,
        *("--train-samples", "32", "--batch-size", "4", "--eval-samples", "8"),
        *("--eval-interval", "4", "--log-interval", "2", "--lr", "1e-2"),
        fresh=True,  # one run of the whole contract in a new interpreter, as a user starts it
    )
    out = tmp_path / "out"
    assert_checkpoint(out / "last-checkpoint", consumed=32)
    best = sorted(out.glob("checkpoint-*"))
    assert best, sorted(p.name for p in out.iterdir())
    for folder in best:
        assert_checkpoint(folder)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temporary folders
    losses = logged_losses(log)
    assert [step for step, _ in losses] == [2, 4, 6, 8], log[-3000:]
    assert losses[-1][1] < losses[0][1], losses
    assert "Eval metric:" in log


@pytest.mark.slow
def test_script_with_liger_fused_ce(tmp_path, tiny_model_dir):
    log = run_script(
        tmp_path,
        tiny_model_dir,
        *("--train-samples", "8", "--batch-size", "4", "--eval-samples", "4"),
        *("--eval-interval", "2", "--log-interval", "1", "--lr", "1e-2", "--enable-liger"),
    )
    assert "fused-CE" in log  # the script's own log line of its fused cross-entropy branch
    assert [step for step, _ in logged_losses(log)] == [1, 2]
    assert_checkpoint(tmp_path / "out" / "last-checkpoint", consumed=8)


@pytest.mark.slow
def test_script_with_torch_baseline(tmp_path, tiny_model_dir):
    log = run_script(
        tmp_path,
        tiny_model_dir,
        *("--train-samples", "8", "--batch-size", "4", "--eval-samples", "4"),
        *("--eval-interval", "2", "--log-interval", "1", "--lr", "1e-2"),
        env={"TWINKLE_TORCH_BASELINE": "1"},
    )
    assert "kernelize" not in log  # the baseline never calls kernelize()
    assert [step for step, _ in logged_losses(log)] == [1, 2]
    assert_checkpoint(tmp_path / "out" / "last-checkpoint", consumed=8)
