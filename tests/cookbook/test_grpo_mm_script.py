"""``cookbook/mm/grpo_mm.py``: GRPO on image prompts (the bundled digits and shapes), the sampler
sharing the trainer's modules.

On the tests' tiny Qwen2.5-VL with tiny settings it runs its steps (each sampling the pictures'
prompts and training on the rows that carry them), writes the reward metrics and completion
lengths to metrics.jsonl, logs the held-out greedy accuracy before and after, and saves an
adapter holding the vision tower (``--train-vision true``) and LoRA on the language model, from
which a second run starts (``--init-adapter``). With no ``--model-id`` the made checkpoint's
supervised warm-up leaves replies that differ within a prompt's copies, so GRPO's advantages are
not all 0 and its steps move the weights."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import warm
from harness import script_env
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "cookbook" / "mm" / "grpo_mm.py"
MAX_TOKENS = 4
FLAGS = ("--max-steps", "2", "--batch-size", "2", "--num-generations", "2", "--max-tokens", str(MAX_TOKENS),
         "--train-samples", "8", "--eval-samples", "4", "--train-vision", "true")  # fmt: skip
REWARDS = {
    "train/accuracy_reward": 1,
    "train/parts_reward": 1,
    "train/format_reward": 1,
    "train/total_reward": 3,
}


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "tests" / "multimodal"))
    from tiny_vl import build_tiny_vl

    return build_tiny_vl(tmp_path_factory.mktemp("tiny-vl"))


@pytest.mark.slow  # a subprocess that samples and trains: over 10 s
def test_two_steps_on_image_prompts_write_rewards_and_save_the_adapter(tiny_vl, tmp_path):
    out = tmp_path / "out"
    command = [str(SCRIPT), "--model-id", str(tiny_vl), "--output-dir", str(out), *FLAGS]
    done = warm.run(command, cwd=tmp_path, env=script_env(tmp_path), timeout=300)  # its own process
    assert done.returncode == 0, done.stderr[-4000:]
    assert "held-out greedy accuracy before training:" in done.stderr
    assert "held-out greedy accuracy: " in done.stderr and "after (chance 0.045)" in done.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for record in train:
        assert all(0.0 <= record[k] <= top for k, top in REWARDS.items()), record
        assert 1 <= record["train/completion_length"] <= MAX_TOKENS
    saved = load_file(out / "last-checkpoint" / "adapter_model.safetensors")
    assert any(".visual." in k and "lora" not in k for k in saved)  # the tower trained whole
    assert any(".language_model." in k and "lora_A" in k for k in saved)
    # a run that starts from a saved adapter (fsdp2.py's, here the first run's)
    again = [*command[: -len(FLAGS)], *FLAGS[:-2], "--init-adapter", str(out / "last-checkpoint")]
    again[again.index("--output-dir") + 1] = str(tmp_path / "again")
    again[again.index("--max-steps") + 1] = "1"
    done = warm.run(again, cwd=tmp_path, env=script_env(tmp_path), timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"loaded adapter 'default' from {out / 'last-checkpoint'}" in done.stderr


# Makes the checkpoint (about 30 s), warms it up and samples: over a minute, so out of the default
# run (CI runs it with the cluster tests). The tiny model's runs above check the same pipeline:
# the warm-up's steps, the rewards in range and the saved adapter.
@pytest.mark.slow
@pytest.mark.long
def test_the_warm_up_gives_groups_whose_rewards_differ(tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, str(SCRIPT), "--output-dir", str(out), "--max-steps", "3",
               "--train-samples", "12", "--eval-samples", "4"]  # fmt: skip
    done = subprocess.run(
        command, cwd=tmp_path, env=script_env(tmp_path), capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "supervised warm-up: 15 steps of 8 pictures" in done.stderr
    steps = re.findall(
        r"step \d+/3 \([\d.]+s, (\d+)/4 groups with differing rewards\): .*grad_norm=([\d.]+)", done.stderr
    )
    assert len(steps) == 3, done.stderr[-4000:]
    # some prompt's copies earned different rewards, and that step's gradient is not 0
    assert any(int(varied) > 0 and float(norm) > 0 for varied, norm in steps), steps
    train = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(r["kind"] == "train" and r.get("train/format_reward", 0) > 0 for r in train)


@pytest.mark.slow  # a subprocess that warms up, samples and trains: about 30 s
def test_the_progress_counts_the_warm_up_and_ends_at_100_percent(tiny_vl, tmp_path):
    """The warm-up's steps share the step counter with GRPO's: the progress line's total holds
    both, so it ends at 100% (it read 200% and more when the total was GRPO's alone)."""
    command = [str(SCRIPT), "--model-id", str(tiny_vl), "--output-dir", str(tmp_path / "out"),
               *FLAGS[:-2], "--sft-steps", "3"]  # fmt: skip
    done = warm.run(command, cwd=tmp_path, env=script_env(tmp_path), timeout=300)  # its own process
    assert done.returncode == 0, done.stderr[-4000:]
    assert "supervised warm-up: 3 steps" in done.stderr
    shown = [
        (int(a), int(b), int(p))
        for a, b, p in re.findall(r"progress: step (\d+)/(\d+) \((\d+)%\)", done.stderr)
    ]
    assert shown == [(4, 5, 80), (5, 5, 100)], done.stderr[-4000:]
