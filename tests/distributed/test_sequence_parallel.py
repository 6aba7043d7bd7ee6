"""Ulysses sequence parallelism on 2 gloo ranks (and on 4: dp 2 x fsdp 2, two Ulysses groups of
2) equals one process on the same batch.

``sp_worker.py`` runs 3 LoRA steps on 4 chat samples of unequal length (one longer than half of
the packed row, so it straddles the ranks' shares) with ``ulysses_size=2`` over 2 FSDP2 ranks:
both ranks read all 4 rows, each runs half of the positions, attention all-to-alls heads for
positions. The loss is the mean over every supervised token either way, so the per-step losses
and gradient norms, and the logps of an evaluation pass, agree up to summation order: within
``run_loss_rtol`` of the tiny model's chain over the batch and the ranks' reduction
(``tests/assets/tolerances.py``), relative. The adapter saved after the steps is within
``adamw_weight_atol`` of one process's. A rank attending only to its own share, a position id
counted from the share's start, or a loss normalised per rank moves the first loss by far more.

Cases: packed (one row, per-sample attention) and padded (``padding_free=False``: each row
attends to its real tokens) batches; activation checkpointing; a tiny Qwen3; a
``MultiLoraTransformersModel`` whose evaluation runs each row through its own adapter; one long
prompt whose targets all lie in the last rank's share; LoRA on the head. A model whose heads the
size does not divide is refused in one line before its weights load."""

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file
from tolerances import adamw_weight_atol, run_loss_rtol

pytestmark = [pytest.mark.slow, pytest.mark.cluster]  # 2-process runs, with the other `-m cluster` suites

WORKER = Path(__file__).with_name("sp_worker.py")
STEPS, LR = 3, 1e-2  # as sp_worker.py runs them


def _run(launcher, model_dir, out: Path, nproc: int, extra: list[str]) -> dict:
    out.mkdir()
    args = ["--model-id", str(model_dir), "--out", str(out), "--steps", str(STEPS), *extra]
    if nproc > 1:
        args += ["--ulysses-size", "2"]
    job = launcher.run(WORKER, args, nproc=nproc)
    assert job.returncode == 0, job.output[-6000:]
    result = json.loads((out / "result.json").read_text())
    result["adapter"] = load_file(out / "adapter" / "adapter_model.safetensors")
    return result


def _tiny_qwen3(tiny_model_dir: Path, out: Path) -> Path:
    """A 2-layer Qwen3 of the tiny Llama's shape, with its tokenizer."""
    import torch
    from tiny import TINY_LLAMA_SHAPE
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        **TINY_LLAMA_SHAPE,
        head_dim=8,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.parametrize(
    ("layout", "ranks"),
    [
        ("packed", 2),
        ("padded", 2),
        # dp 2 x fsdp 2, Ulysses groups {0, 1} and {2, 3}: each group reads 2 of the 4 rows
        ("packed", 4),
        # each layer recomputed in the backward, its all-to-alls with it
        ("checkpointed", 2),
        # Qwen3: q and k normalised per head before the exchange
        ("qwen3", 2),
        # adapter slots; the evaluation runs each row through its own adapter (or none)
        ("mixed", 2),
        # one sample, its targets all in rank 1's share: rank 0 scores nothing, still runs backward
        ("long-prompt", 2),
        # LoRA on the head: the loss reads the logits of each rank's rows
        ("lora-head", 2),
    ],
)
def test_ulysses_equals_one_process(tiny_model_dir, tmp_path, launcher, layout, ranks):
    extra = {
        "padded": ["--padded"],
        "checkpointed": ["--activation-checkpointing", "on"],
        "mixed": ["--mixed"],
        "long-prompt": ["--long-prompt"],
        "lora-head": ["--lora-head"],
    }.get(layout, [])
    model_dir = _tiny_qwen3(tiny_model_dir, tmp_path / "qwen3") if layout == "qwen3" else tiny_model_dir
    one = _run(launcher, model_dir, tmp_path / "one", 1, extra)
    two = _run(
        launcher,
        model_dir,
        tmp_path / "two",
        ranks,
        extra + (["--fsdp-size", "2"] if ranks == 4 else []),
    )
    assert two["world_size"] == ranks
    lengths = one["lengths"]
    assert max(lengths) > sum(lengths) / 2  # a sample longer than a rank's share of the row
    long_prompt = layout == "long-prompt"
    rtol = run_loss_rtol(len(lengths), max(lengths), ranks)
    print(
        f"\n[ulysses 2, {layout}] losses {[s['loss'] for s in one['steps']]} vs {[s['loss'] for s in two['steps']]}"
    )
    assert one["steps"][-1]["loss"] < one["steps"][0]["loss"]  # it trained
    for a, b in zip(one["steps"], two["steps"], strict=True):
        # each rank scored a share of the tokens, not all of them (rank 0 none of a long prompt's)
        assert b["rank_tokens"] == 0 if long_prompt else 0 < b["rank_tokens"] < a["rank_tokens"]
        # the group's ranks hold the same rows: counted once
        for key in ("samples", "tokens", "supervised_tokens"):
            assert a[key] == b[key], (key, a[key], b[key])
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= rtol * max(1.0, abs(a[key])), (key, a[key], b[key], rtol)
    if one["eval"] is not None:  # the evaluation's loss, and its rows and tokens counted once
        assert abs(one["eval"]["loss"] - two["eval"]["loss"]) <= rtol * one["eval"]["loss"]
        assert (one["eval"]["samples"], one["eval"]["tokens"]) == (
            two["eval"]["samples"],
            two["eval"]["tokens"],
        )
    # rank 0's rows (all 4 on 2 ranks, the first 2 on 4), each padded to its batch's length
    assert len(two["logps"]) == len(lengths) * 2 // ranks
    for row_a, row_b in zip(one["logps"], two["logps"], strict=False):
        for x, y in zip(row_a, row_b, strict=False):
            assert abs(x - y) <= rtol * max(1.0, abs(x)), (x, y, rtol)
    atol = adamw_weight_atol(LR, STEPS)
    assert one["adapter"].keys() == two["adapter"].keys() and one["adapter"]
    for name, weight in one["adapter"].items():
        assert (weight - two["adapter"][name]).abs().max() <= atol, name


def test_heads_the_size_does_not_divide_are_one_line(tiny_model_dir, tmp_path, launcher):
    folder = tmp_path / "one-kv-head"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["num_key_value_heads"] = 1  # 4 query heads, 1 key/value head: 2 does not divide it
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").unlink()  # refused before the weights load
    out = tmp_path / "out"
    out.mkdir()
    job = launcher.run(WORKER, ["--model-id", str(folder), "--out", str(out), "--ulysses-size", "2"], nproc=2)
    assert job.returncode != 0
    needle = "ulysses_size=2 does not divide the model's heads (num_attention_heads=4, num_key_value_heads=1)"
    lines = [line for line in job.output.splitlines() if needle in line]
    assert lines, job.output[-4000:]
    assert not (out / "result.json").exists()
