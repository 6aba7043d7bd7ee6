"""Expert parallelism on Qwen3-Next, on 2 gloo ranks (ep_size 2 over 2 FSDP2 shards), equals one
process: a tiny random checkpoint of 2 layers, a gated delta-net (linear attention) layer then a
full-attention one, each a mixture of 8 experts (top-2, renormalised) beside a shared expert with
its sigmoid gate.

Its MoE block calls ``experts(hidden, top_k_index, top_k_weights)`` on fused ``gate_up_proj``
(experts, 2 * intermediate, hidden) and ``down_proj`` (experts, hidden, intermediate) with a plain
SwiGLU, as Qwen3-MoE's does; the shared expert runs on every rank's own tokens, outside the
exchanged experts.

``ep_worker.py`` runs 3 LoRA steps on 4 chat samples, LoRA on the attention and the shared
expert's gate and on the experts (``target_parameters``); the per-step losses, gradient norms and
an evaluation pass's logps agree within ``run_loss_rtol`` (``tests/assets/tolerances.py``), the
saved adapters within ``adamw_weight_atol``, and each rank holds exactly its own 4 of the 8
experts of each MoE layer, as one process loads them."""

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from tolerances import adamw_weight_atol, run_loss_rtol

from twinkle.model.expert_parallel import check_model

pytestmark = [pytest.mark.slow, pytest.mark.cluster]  # 2-process runs, with the other `-m cluster` suites

WORKER = Path(__file__).with_name("ep_worker.py")
STEPS, LR, EXPERTS = 3, 1e-2, 8  # as ep_worker.py runs them; the checkpoint's experts


def build_qwen3_next(tiny_model_dir: Path, out: Path) -> Path:
    ids = json.loads((tiny_model_dir / "config.json").read_text())
    config = transformers.Qwen3NextConfig(
        vocab_size=ids["vocab_size"], eos_token_id=ids.get("eos_token_id"), pad_token_id=ids.get("pad_token_id"),
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"],
        num_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        decoder_sparse_step=1, norm_topk_prob=True, max_position_embeddings=512, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.Qwen3NextForCausalLM(config).save_pretrained(out)
    for path in tiny_model_dir.iterdir():
        if "token" in path.name or path.suffix == ".jinja":
            (out / path.name).write_bytes(path.read_bytes())
    return out


def _run(launcher, model_dir: Path, out: Path, nproc: int) -> dict:
    out.mkdir()
    args = ["--model-id", str(model_dir), "--out", str(out), "--steps", str(STEPS), "--target-parameters"]
    if nproc > 1:
        args += ["--ep-size", "2"]
    job = launcher.run(WORKER, args, nproc=nproc, timeout_s=240)
    assert job.returncode == 0, job.output[-6000:]
    result = json.loads((out / "result.json").read_text())
    result["adapter"] = load_file(out / "adapter" / "adapter_model.safetensors")
    return result


def test_qwen3_next_is_a_family_expert_parallelism_runs():
    config = transformers.Qwen3NextConfig(num_experts=EXPERTS, num_hidden_layers=2)
    check_model(config, 2)  # no error: the fused layout and call of Qwen3-MoE


def test_qwen3_next_under_expert_parallelism_equals_one_process(tiny_model_dir, tmp_path, launcher):
    model_dir = build_qwen3_next(tiny_model_dir, tmp_path / "qwen3_next")
    one = _run(launcher, model_dir, tmp_path / "one", 1)
    two = _run(launcher, model_dir, tmp_path / "two", 2)
    assert two["world_size"] == 2
    lengths = one["lengths"]
    rtol = run_loss_rtol(len(lengths), max(lengths), 2)
    print(
        f"\n[ep 2, qwen3_next] losses {[s['loss'] for s in one['steps']]} vs {[s['loss'] for s in two['steps']]}"
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
    # the experts' LoRA of both MoE layers is saved whole (r x 8 experts rows of A), with the
    # full-attention layer's and the shared expert gate's
    expert_lora = [name for name in one["adapter"] if ".experts." in name and "lora_A" in name]
    assert len(expert_lora) == 4 and all(one["adapter"][n].shape[0] == 4 * EXPERTS for n in expert_lora)
    assert any("self_attn" in name for name in one["adapter"])
    assert any("shared_expert_gate" in name for name in one["adapter"])
    atol = adamw_weight_atol(LR, STEPS)
    assert one["adapter"].keys() == two["adapter"].keys()
    for name, weight in one["adapter"].items():
        assert (weight - two["adapter"][name]).abs().max() <= atol, name
    # one process holds all 8 experts of both layers; rank r its block r, exactly
    full = load_file(tmp_path / "one" / "experts-0.safetensors")
    assert sorted(full) == [
        f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("down_proj", "gate_up_proj")
    ]
    for rank in range(2):
        held = load_file(tmp_path / "two" / f"experts-{rank}.safetensors")
        assert held.keys() == full.keys()
        for name, weight in full.items():
            block = weight[rank * EXPERTS // 2 : (rank + 1) * EXPERTS // 2]
            assert torch.equal(held[name], block), (rank, name)
