"""``cookbook/rl/multi_turn_grpo.py`` on the tiny model (its replies are noise, so rewards are
mostly 0): one step plays the episodes, trains, writes the reward metrics and saves the adapter."""

import json
import shutil
from pathlib import Path

import pytest
import warm
from harness import script_env

SCRIPT = Path(__file__).resolve().parents[2] / "cookbook" / "rl" / "multi_turn_grpo.py"


@pytest.mark.slow
def test_one_step_trains_and_saves(tmp_path, tiny_model_dir):
    # the tiny tokenizer spells the few-shot prompt in many more tokens than SmolLM2's: room for them
    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "tiny")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    flags = ["--max-steps", "1", "--batch-size", "2", "--num-generations", "2", "--max-tokens", "4"]
    argv = [str(SCRIPT), "--model-id", str(model_dir), "--output-dir", str(tmp_path / "out"), *flags,
            "--eval-samples", "2", "--lora-dropout", "0"]  # fmt: skip
    result = warm.run(argv, cwd=tmp_path, env=script_env(tmp_path), timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "held-out greedy success: 0.000 before" in result.stderr
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    (train,) = [r for r in rows if r["kind"] == "train"]
    assert 0.0 <= train["train/success_reward"] <= 1.0 and "train/clean_call_reward" in train
    assert (tmp_path / "out" / "last-checkpoint" / "adapter_model.safetensors").is_file()
