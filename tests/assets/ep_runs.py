"""The expert-parallel equality check the MoE families' tests share: ``ep_worker.py`` run in one
process and on 2 gloo ranks (ep_size 2), then the runs compared: per-step losses, gradient norms
and an evaluation pass's logps within ``run_loss_rtol``, the saved adapters within
``adamw_weight_atol``, every MoE layer's expert LoRA saved whole, and each rank holding exactly
its own block of the experts (weights, and biases where the family has them) one process loads."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from tolerances import adamw_weight_atol, run_loss_rtol

WORKER = Path(__file__).resolve().parents[1] / "distributed" / "ep_worker.py"


def run_ep_worker(
    launcher, model_dir: Path, out: Path, nproc: int, steps: int, parallel: tuple[str, ...] = ()
) -> dict:
    """``parallel``: more of the worker's flags for the run on ``nproc > 1`` ranks (``--ulysses-size 2``)."""
    out.mkdir()
    args = ["--model-id", str(model_dir), "--out", str(out), "--steps", str(steps), "--target-parameters"]
    if nproc > 1:
        args += ["--ep-size", "2", *parallel]
    job = launcher.run(WORKER, args, nproc=nproc, timeout_s=240)
    assert job.returncode == 0, job.output[-6000:]
    result = json.loads((out / "result.json").read_text())
    result["adapter"] = load_file(out / "adapter" / "adapter_model.safetensors")
    return result


def assert_ep_equals_one_process(
    one: dict, two: dict, label: str, lr: float, steps: int, experts: int, moe_layers: tuple[int, ...],
    one_dir: Path, two_dir: Path, biases: bool = False,
) -> None:  # fmt: skip
    """``biases``: the experts carry ``gate_up_proj_bias`` and ``down_proj_bias`` (gpt-oss), held
    in blocks like their weights."""
    assert two["world_size"] == 2
    lengths = one["lengths"]
    rtol = run_loss_rtol(len(lengths), max(lengths), 2)
    print(
        f"\n[ep 2, {label}] losses {[s['loss'] for s in one['steps']]} vs {[s['loss'] for s in two['steps']]}"
    )
    assert one["steps"][-1]["loss"] < one["steps"][0]["loss"]  # it trained
    for a, b in zip(one["steps"], two["steps"], strict=True):
        for key in ("samples", "supervised_tokens"):
            assert a[key] == b[key], (key, a[key], b[key])
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= rtol * max(1.0, abs(a[key])), (key, a[key], b[key], rtol)
    for row_a, row_b in zip(one["logps"], two["logps"], strict=False):  # rank 0's rows
        for x, y in zip(row_a, row_b, strict=False):
            assert abs(x - y) <= rtol * max(1.0, abs(x)), (x, y, rtol)
    # each MoE layer's expert LoRA is saved whole (r x experts rows of A, r 4)
    expert_lora = [name for name in one["adapter"] if ".experts." in name and "lora_A" in name]
    assert len(expert_lora) == 2 * len(moe_layers)
    assert all(one["adapter"][n].shape[0] == 4 * experts for n in expert_lora)
    assert any("self_attn" in name for name in one["adapter"])
    atol = adamw_weight_atol(lr, steps)
    assert one["adapter"].keys() == two["adapter"].keys()
    for name, weight in one["adapter"].items():
        assert (weight - two["adapter"][name]).abs().max() <= atol, name
    # one process holds every expert of the MoE layers; rank r its block r, exactly
    full = load_file(one_dir / "experts-0.safetensors")
    names = ("down_proj", "down_proj_bias", "gate_up_proj", "gate_up_proj_bias")
    names = names if biases else names[::2]
    assert sorted(full) == [f"model.layers.{i}.mlp.experts.{p}" for i in moe_layers for p in names]
    for rank in range(2):
        held = load_file(two_dir / f"experts-{rank}.safetensors")
        assert held.keys() == full.keys()
        for name, weight in full.items():
            block = weight[rank * experts // 2 : (rank + 1) * experts // 2]
            assert torch.equal(held[name], block), (rank, name)
