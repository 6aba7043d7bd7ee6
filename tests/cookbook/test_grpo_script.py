"""``cookbook/rl/grpo_math.py``: GRPO with LoRA on the bundled arithmetic problems, the sampler
sharing the trainer's modules.

On the tiny model (its completions are noise, so rewards are mostly 0): 2 steps write the reward
metrics, the completion length and the held-out greedy accuracy to metrics.jsonl, and save a
PEFT adapter; 2 FSDP2 gloo ranks (each sampling its share of the prompts) do the same."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import warm
from harness import script_env
from ports import free_port

SCRIPT = Path(__file__).resolve().parents[2] / "cookbook" / "rl" / "grpo_math.py"
MAX_TOKENS = 4
FLAGS = (
    "--max-steps", "2", "--batch-size", "2", "--num-generations", "2", "--max-tokens", str(MAX_TOKENS),
    "--train-samples", "8", "--eval-samples", "4", "--eval-interval", "1", "--lora-dropout", "0",
)  # fmt: skip
REWARD_KEYS = ("train/accuracy_reward", "train/format_reward", "train/total_reward", "train/total_reward_std")


def train_records(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"]


def check_run(out: Path) -> None:
    train = train_records(out)
    assert [r["step"] for r in train] == [1, 2]
    for record in train:
        assert all(0.0 <= record[k] <= 2.0 for k in REWARD_KEYS), record
        assert 1 <= record["train/completion_length"] <= MAX_TOKENS
        assert 0.0 <= record["eval/greedy_accuracy"] <= 1.0  # step 1 carries the base model's
        assert 0.0 <= record["clip_fraction"] <= 1.0 and "accuracy" not in record  # GRPOLoss's clip count
    assert (out / "last-checkpoint" / "adapter_model.safetensors").is_file()


def test_two_steps_write_the_reward_metrics_and_save_the_adapter(tmp_path, tiny_model_dir):
    argv = [str(SCRIPT), "--model-id", str(tiny_model_dir), "--output-dir", str(tmp_path / "out"), *FLAGS]
    result = warm.run(argv, cwd=tmp_path, env=script_env(tmp_path), timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "held-out greedy accuracy:" in result.stderr
    check_run(tmp_path / "out")


@pytest.mark.slow
@pytest.mark.cluster  # a 2-process run: with the other multi-process suites in `-m cluster` (CI runs both)
def test_two_fsdp_ranks_sample_their_shares(tmp_path, tiny_model_dir):
    env = {k: v for k, v in script_env(tmp_path).items() if not k.startswith("TWINKLE_")}
    env.update(TWINKLE_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        str(SCRIPT), "--model-id", str(tiny_model_dir), "--output-dir", str(tmp_path / "out"), *FLAGS,
        "--fsdp-size", "2",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    check_run(tmp_path / "out")
