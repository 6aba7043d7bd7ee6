"""``cookbook/transformers/multi_lora.py``: two identities trained at once on the tiny model, each
saved as its own PEFT adapter; a bad identity list is one line of error."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import warm
from harness import assert_one_line_error, script_env
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from twinkle.cli.main import main as twinkle_main

SCRIPT = Path(__file__).resolve().parents[2] / "cookbook" / "transformers" / "multi_lora.py"
RANKS = {"twinkle": 8, "pip": 16}  # the script's defaults
FLAGS = ("--train-samples", "8", "--batch-size", "4", "--eval-samples", "4", "--log-interval", "1")


def run(tmp_path: Path, model_dir: Path, *flags: str):
    argv = [str(SCRIPT), "--model-id", str(model_dir), "--output-dir", str(tmp_path / "out"), *flags]
    return warm.run(argv, cwd=tmp_path, env=script_env(tmp_path), timeout=300)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_dir):
    """The script's two default identities, 2 steps each (8 samples in batches of 4)."""
    tmp = tmp_path_factory.mktemp("multi-lora")
    result = run(tmp, tiny_model_dir, *FLAGS, "--lr", "1e-2")
    assert result.returncode == 0, result.stderr[-4000:]
    return tmp / "out", result.stderr


@pytest.mark.slow
def test_each_identity_is_its_own_peft_adapter(trained, tiny_model_dir):
    """Each folder loads in plain PEFT with its own rank, holds its own optimizer's state (Muon's
    momentum, AdamW's moments) and changes the base model's logits its own way."""
    out, _ = trained
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = {"base": base(input_ids=ids).logits}
    for name, rank in RANKS.items():
        folder = out / name / "last-checkpoint"
        assert (folder / ".twinkle-complete").is_file()
        state = json.loads((folder / "trainer_state.json").read_text())
        assert (state["optimizer_steps"], state["consumed_train_samples"]) == (2, 8)
        assert json.loads((folder / "adapter_config.json").read_text())["r"] == rank
        model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32), str(folder)
        ).eval()
        lora_a = [p for n, p in model.named_parameters() if "lora_A" in n]
        assert lora_a and {p.shape[0] for p in lora_a} == {rank}
        with torch.no_grad():
            logits[name] = model(input_ids=ids).logits
        optimizer = torch.load(folder / "optimizer.pt", weights_only=True)
        moments = {key for entry in optimizer["state"].values() for key in entry}
        assert moments == ({"momentum_buffer"} if name == "twinkle" else {"step", "exp_avg", "exp_avg_sq"})
    assert not torch.equal(logits["twinkle"], logits["base"])
    assert not torch.equal(logits["pip"], logits["base"])
    assert not torch.equal(logits["twinkle"], logits["pip"])


@pytest.mark.slow
def test_metrics_are_recorded_per_adapter(trained):
    """metrics.jsonl names the adapter of each record; the identities alternate batch by batch,
    each with its own step count, and the log says whose numbers it prints."""
    out, log = trained
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [(r["adapter"], r["step"]) for r in records if r["kind"] == "train"]
    assert train == [("twinkle", 1), ("pip", 1), ("twinkle", 2), ("pip", 2)]
    evals = {r["adapter"]: r["loss"] for r in records if r["kind"] == "eval"}
    assert evals.keys() == {"twinkle", "pip"} and evals["twinkle"] != evals["pip"]
    assert "[twinkle] step 2 of 2" in log and "[pip] step 2 of 2" in log
    assert (out / "curves.png").is_file()
    summary = [line for line in log.splitlines() if "run summary:" in line]
    assert len(summary) == 1, log[-3000:]
    for adapter in RANKS:  # each adapter's best eval, with the folder its save of that step went to
        best = min(
            (r for r in records if r["kind"] == "eval" and r["adapter"] == adapter), key=lambda r: r["loss"]
        )
        folder = out / adapter / f"checkpoint-{best['step']}"
        assert f"{adapter} {best['loss']:.4f} at step {best['step']} ({folder})" in summary[0], summary[0]


@pytest.mark.slow
def test_twinkle_chat_loads_each_adapter(trained, tiny_model_dir, capsys):
    out, _ = trained
    for name in RANKS:
        folder = out / name / "last-checkpoint"
        argv = ["chat", "--adapter", str(folder), "--model-id", str(tiny_model_dir)]
        assert twinkle_main([*argv, "--prompt", "Who are you?", "--max-new-tokens", "4"]) == 0
        assert "> Who are you?" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, message",
    [
        (("--adapters", "pip,pip"), r"--adapters names 'pip' twice; give each identity its own adapter name"),
        (("--ranks", "8"), r"--ranks 8: give one non-empty entry per adapter \(--adapters twinkle,pip\)"),
        (("--ranks", "8,0"), r"--ranks 8,0: each LoRA rank must be an integer >= 1"),
        (("--optimizers", "Muon,Adamw"), r"--optimizers: unknown optimizer 'Adamw'"),
        (("--adapters", "twinkle,tensorboard"), r"--adapters 'tensorboard': .* pick another adapter name"),
    ],
)
def test_a_bad_identity_list_is_one_line(tmp_path, tiny_model_dir, flags, message):
    result = run(tmp_path, tiny_model_dir, *FLAGS, *flags)
    assert_one_line_error(result, message, tmp_path / "out")


@pytest.mark.slow
def test_resume_auto_continues_each_adapter(tmp_path, tiny_model_dir):
    """A run whose last step was lost (``last-checkpoint`` of each adapter deleted after the run)
    resumed with ``--resume-from-checkpoint auto`` continues each adapter from its
    ``checkpoint-1`` and ends with the uninterrupted run's adapters, bit for bit."""
    flags = (*FLAGS, "--eval-interval", "1", "--seed", "7")
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    whole.mkdir(), cut.mkdir()
    for folder in (whole, cut):
        result = run(folder, tiny_model_dir, *flags)
        assert result.returncode == 0, result.stderr[-4000:]
    for adapter in RANKS:
        assert (cut / "out" / adapter / "checkpoint-1").is_dir()
        shutil.rmtree(cut / "out" / adapter / "last-checkpoint")
    result = run(cut, tiny_model_dir, *flags, "--resume-from-checkpoint", "auto")
    assert result.returncode == 0, result.stderr[-4000:]
    for adapter in RANKS:
        assert f"[{adapter}] resumed from" in result.stderr
        done = load_file(whole / "out" / adapter / "last-checkpoint" / "adapter_model.safetensors")
        resumed = load_file(cut / "out" / adapter / "last-checkpoint" / "adapter_model.safetensors")
        assert done.keys() == resumed.keys()
        for key in done:
            assert torch.equal(done[key], resumed[key]), key


@pytest.mark.slow
def test_an_explicit_resume_folder_is_one_line(tmp_path, tiny_model_dir):
    folder = tmp_path / "somewhere"
    folder.mkdir()
    result = run(tmp_path, tiny_model_dir, *FLAGS, "--resume-from-checkpoint", str(folder))
    assert_one_line_error(
        result, r"pass --resume-from-checkpoint auto to resume every adapter", tmp_path / "out"
    )
