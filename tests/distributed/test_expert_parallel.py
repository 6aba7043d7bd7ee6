"""Expert parallelism on 2 gloo ranks (ep_size 2 over 2 FSDP2 shards; and on 4, two ranks per
block of experts) equals one process on the same batch, for a tiny Qwen3-MoE, Qwen2-MoE and
Qwen3.5-MoE (8 experts, top-2; Qwen2-MoE not renormalised, Qwen2-MoE and Qwen3.5-MoE with a
shared expert, Qwen3.5-MoE a linear-attention layer before its full-attention one).

``ep_worker.py`` runs 3 LoRA steps (attention and the shared expert's gate; with
``target_parameters`` the experts too) on 4 chat samples: each rank reads its share of them,
holds 4 of the 8 experts of every MoE layer, and sends each token to the rank holding each
expert it chose. The loss is the mean over every supervised token either way, so the per-step losses, gradient norms and an evaluation pass's logps agree up to
summation order: within ``run_loss_rtol`` of the tiny model's chain over the batch and the
ranks' reduction (``tests/assets/tolerances.py``), relative. The adapter saved after the steps
is within ``adamw_weight_atol`` of one process's, the experts' LoRA whole. Each rank's expert
weights are its own block of the checkpoint's experts, exactly (they are frozen). Tokens run through the neighbouring
expert of the rank's block move the first gradient norm three times past the bound (the random
experts add little to the tiny model's output, so the loss moves less).

What is refused before training, in one line on every rank: a dense model and an expert count
ep_size does not divide. Ulysses, routing replay and full-parameter training with it run
(``test_ep_ulysses.py``, ``test_ep_replay.py``, ``test_ep_full_parameter.py``)."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tolerances import adamw_weight_atol, run_loss_rtol

sys.path.insert(0, str(Path(__file__).parents[1] / "moe"))  # the tiny MoE builders
from tiny_moe import EXPERTS, build_qwen2_moe, build_qwen3_5_moe, build_qwen3_moe  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.cluster]  # 2-process runs, with the other `-m cluster` suites

WORKER = Path(__file__).with_name("ep_worker.py")
STEPS, LR = 3, 1e-2  # as ep_worker.py runs them
BUILDERS = {"qwen3_moe": build_qwen3_moe, "qwen2_moe": build_qwen2_moe, "qwen3_5_moe": build_qwen3_5_moe}


def _run(launcher, model_dir: Path, out: Path, nproc: int, extra: list[str] = ()) -> dict:
    out.mkdir()
    args = ["--model-id", str(model_dir), "--out", str(out), "--steps", str(STEPS), *extra]
    if nproc > 1:
        args += ["--ep-size", "2"]
    job = launcher.run(WORKER, args, nproc=nproc)
    assert job.returncode == 0, job.output[-6000:]
    result = json.loads((out / "result.json").read_text())
    result["adapter"] = load_file(out / "adapter" / "adapter_model.safetensors")
    return result


def _fused_experts(model_dir: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's experts as the model holds them: ``gate_up_proj`` (experts, 2 * I, H),
    ``down_proj`` (experts, H, I) per layer (the file keeps one matrix per expert)."""
    saved = load_file(model_dir / "model.safetensors")
    out = {}
    for layer in range(2):
        head = f"model.layers.{layer}.mlp.experts"
        gate_up = [
            torch.cat([saved[f"{head}.{e}.gate_proj.weight"], saved[f"{head}.{e}.up_proj.weight"]])
            for e in range(EXPERTS)
        ]
        out[f"{head}.gate_up_proj"] = torch.stack(gate_up)
        out[f"{head}.down_proj"] = torch.stack(
            [saved[f"{head}.{e}.down_proj.weight"] for e in range(EXPERTS)]
        )
    return out


@pytest.mark.parametrize(
    ("family", "ranks", "lora"),
    [(family, 2, "attention") for family in sorted(BUILDERS)]
    # LoRA on the experts too (target_parameters): each rank adds its block's update
    + [("qwen3_moe", 2, "experts"), ("qwen3_5_moe", 2, "experts")]
    # 4 ranks: experts 0-3 on ranks 0 and 1, 4-7 on ranks 2 and 3; tokens go between 0 and 2, 1 and 3
    + [("qwen3_moe", 4, "experts")],
)
def test_expert_parallel_equals_one_process(tiny_model_dir, tmp_path, launcher, family, ranks, lora):
    model_dir = BUILDERS[family](tiny_model_dir, tmp_path / family)
    extra = ["--target-parameters"] if lora == "experts" else []
    one = _run(launcher, model_dir, tmp_path / "one", 1, extra)
    two = _run(launcher, model_dir, tmp_path / "two", ranks, extra)
    assert two["world_size"] == ranks
    lengths = one["lengths"]
    rtol = run_loss_rtol(len(lengths), max(lengths), ranks)
    print(
        f"\n[ep 2 on {ranks}, {family}] losses {[s['loss'] for s in one['steps']]} vs {[s['loss'] for s in two['steps']]}"
    )
    assert one["steps"][-1]["loss"] < one["steps"][0]["loss"]  # it trained
    for a, b in zip(one["steps"], two["steps"], strict=True):
        for key in ("samples", "supervised_tokens"):
            assert a[key] == b[key], (key, a[key], b[key])
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= rtol * max(1.0, abs(a[key])), (key, a[key], b[key], rtol)
    # rank 0's rows of the evaluation pass: the first of one process's 4
    assert len(two["logps"]) == len(lengths) // ranks
    for row_a, row_b in zip(one["logps"], two["logps"], strict=False):
        for x, y in zip(row_a, row_b, strict=False):
            assert abs(x - y) <= rtol * max(1.0, abs(x)), (x, y, rtol)
    atol = adamw_weight_atol(LR, STEPS)
    assert one["adapter"].keys() == two["adapter"].keys() and one["adapter"]
    # the experts' LoRA is saved whole, as one process saves it: r x 8 experts rows of A
    expert_lora = [name for name in one["adapter"] if ".experts." in name and "lora_A" in name]
    assert len(expert_lora) == (4 if lora == "experts" else 0)
    assert all(one["adapter"][name].shape[0] == 4 * EXPERTS for name in expert_lora)
    for name, weight in one["adapter"].items():
        assert (weight - two["adapter"][name]).abs().max() <= atol, name
    # each rank holds its own 4 of the 8 experts, as loaded (one process holds all 8)
    full = _fused_experts(model_dir)
    assert {k: v.shape for k, v in load_file(tmp_path / "one" / "experts-0.safetensors").items()} == {
        k: v.shape for k, v in full.items()
    }
    for rank in range(ranks):
        held = load_file(tmp_path / "two" / f"experts-{rank}.safetensors")
        assert held.keys() == full.keys()
        block_index = rank // (ranks // 2)  # ep_rank: expert groups of consecutive ranks
        for name, weight in full.items():
            block = weight[block_index * EXPERTS // 2 : (block_index + 1) * EXPERTS // 2]
            assert held[name].shape == block.shape and torch.equal(held[name], block), (rank, name)


def _refused(launcher, model_dir: Path, out: Path, extra: list[str], needle: str) -> None:
    out.mkdir()
    job = launcher.run(WORKER, ["--model-id", str(model_dir), "--out", str(out), *extra], nproc=2)
    assert job.returncode != 0
    # one line from each rank (the ranks' outputs interleave, so a line may run on into the other's)
    assert job.output.count("error: " + needle) == 2, job.output[-4000:]
    assert not any(
        line.startswith('  File "' + str(Path(__file__).parents[2] / "src"))
        for line in job.output.splitlines()
    )
    assert not (out / "result.json").exists()


def _without_weights(model_dir: Path, out: Path, **config_changes) -> Path:
    """``model_dir`` without its weights (a refusal comes before they load), config changed."""
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config.update(config_changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("dense", "ep_size=2: llama is a dense model (no experts to split)"),
        ("seven-experts", "ep_size=2 does not divide the model's 7 experts"),
    ],
)
def test_what_expert_parallelism_refuses(tiny_model_dir, tmp_path, launcher, case, needle):
    extra = ["--ep-size", "2"]
    if case == "dense":
        model_dir = _without_weights(tiny_model_dir, tmp_path / "dense")
    else:
        model_dir = _without_weights(
            build_qwen3_moe(tiny_model_dir, tmp_path / "moe"), tmp_path / "seven", num_local_experts=7
        )
    _refused(launcher, model_dir, tmp_path / "out", extra, needle)
