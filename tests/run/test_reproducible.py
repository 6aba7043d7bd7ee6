"""The same command gives the same numbers: two fresh processes, each with a fresh cache, started
together so that each loads the machine while the other runs, log the same losses and write a
bit-identical adapter.

Nothing on the default path may depend on timing or load: the frozen weights' products go to
oneDNN by a fixed rule (``TWINKLE_ONEDNN=on``), never by a measurement that a busy machine can
flip, so neither run writes a measured route into its cache. Activation checkpointing, which
follows the free memory, leaves the numbers alone.

In ``tests/run`` because it compares whole runs of the real script, from the cache to the adapter."""

import re
import subprocess
from pathlib import Path

import torch
from harness import script_command, script_env, trainable
from peft import LoraConfig
from safetensors.torch import load_file

from twinkle.model import TransformersModel, activation_checkpointing

FLAGS = (
    *("--train-samples", "16", "--batch-size", "4", "--eval-samples", "4"),
    *("--eval-interval", "2", "--log-interval", "1", "--lr", "1e-2"),
)
STEPS = 4
STEP_LINE = re.compile(r"Current is step (\d+) of \d+, metric: \{'loss': ([^,}]+)")
EVAL_LINE = re.compile(r"Eval metric: \{[^}]*'loss': ([^,}]+)")


def _start(tmp_path: Path, model_dir: Path, name: str) -> tuple[subprocess.Popen, Path, Path]:
    """The contract script in a fresh interpreter with a cache of its own; its stderr to a file."""
    folder = tmp_path / name
    folder.mkdir()
    env = script_env(folder)  # a fresh TWINKLE_CACHE under ``folder``
    env.pop("TWINKLE_ONEDNN", None)  # the default path
    log = folder / "stderr.log"
    with open(log, "w") as handle:
        proc = subprocess.Popen(
            script_command(model_dir, folder / "out", *FLAGS),
            cwd=folder,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=handle,
        )
    return proc, folder, log


def _finish(proc: subprocess.Popen, log: Path) -> str:
    try:
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    return text


def test_two_fresh_processes_with_fresh_caches_give_identical_losses_and_adapter(tmp_path, tiny_model_dir):
    runs = [_start(tmp_path, tiny_model_dir, name) for name in ("first", "second")]
    logs = [_finish(proc, log) for proc, _, log in runs]
    steps = [STEP_LINE.findall(text) for text in logs]
    assert [int(step) for step, _ in steps[0]] == list(range(1, STEPS + 1)), logs[0][-3000:]
    assert steps[0] == steps[1]
    evals = [EVAL_LINE.findall(text) for text in logs]
    assert len(evals[0]) == STEPS // 2 and evals[0] == evals[1], logs[0][-3000:]
    # the oneDNN route was taken (packed copies for the forward products), by the rule: no run
    # measured a route, so no cache holds one
    for text, (_, folder, _) in zip(logs, runs, strict=True):
        assert "frozen weights packed for oneDNN" in text, text[-3000:]
        assert not list((folder / "twinkle-cache").glob("gemm/routes-*.json"))
    adapters = [
        load_file(folder / "out" / "last-checkpoint" / "adapter_model.safetensors") for _, folder, _ in runs
    ]
    assert adapters[0].keys() == adapters[1].keys() and adapters[0]
    for name, tensor in adapters[0].items():
        assert torch.equal(tensor, adapters[1][name]), name
    # the runs trained: the adapter moved away from its initialisation (B starts at zero)
    assert any(bool(t.abs().sum()) for n, t in adapters[0].items() if "lora_B" in n)


def _train(model_dir: Path, dataset, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor], bool]:
    """Losses, final LoRA weights, and whether checkpointing was on, for a seeded run with dropout."""
    model = TransformersModel(str(model_dir))
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.1)
    model.add_adapter_to_model("default", config)
    model.set_optimizer("AdamW", lr=1e-2)
    losses = []
    for step in range(steps):
        losses.append(model.forward_backward(inputs=[dataset[4 * step + i] for i in range(4)]))
        model.clip_grad_and_step()
    return losses, trainable(model), model.checkpointing.active


def test_checkpointing_that_free_memory_switches_leaves_the_numbers_alone(
    monkeypatch, tiny_model_dir, dataset
):
    """``auto`` activation checkpointing follows the memory free at each micro-batch, which other
    processes change: recomputing the layers (and their dropout masks) must give the same sums."""
    runs = {}
    for free in (1, 2**50):  # no memory left: checkpointed; plenty: not
        monkeypatch.setattr(activation_checkpointing, "available_bytes", lambda device, free=free: free)
        runs[free] = _train(tiny_model_dir, dataset)
    (tight_losses, tight, tight_on), (loose_losses, loose, loose_on) = runs[1], runs[2**50]
    assert tight_on and not loose_on
    assert tight_losses == loose_losses
    assert tight.keys() == loose.keys() and all(torch.equal(tight[n], loose[n]) for n in tight)
