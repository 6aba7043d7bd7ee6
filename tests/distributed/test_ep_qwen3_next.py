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
from ep_runs import assert_ep_equals_one_process, run_ep_worker

from twinkle.model.expert_parallel import check_model

pytestmark = [pytest.mark.slow, pytest.mark.cluster]  # 2-process runs, with the other `-m cluster` suites

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


def test_qwen3_next_is_a_family_expert_parallelism_runs():
    config = transformers.Qwen3NextConfig(num_experts=EXPERTS, num_hidden_layers=2)
    check_model(config, 2)  # no error: the fused layout and call of Qwen3-MoE


def test_qwen3_next_under_expert_parallelism_equals_one_process(tiny_model_dir, tmp_path, launcher):
    model_dir = build_qwen3_next(tiny_model_dir, tmp_path / "qwen3_next")
    one = run_ep_worker(launcher, model_dir, tmp_path / "one", 1, STEPS)
    two = run_ep_worker(launcher, model_dir, tmp_path / "two", 2, STEPS)
    assert_ep_equals_one_process(
        one, two, "qwen3_next", LR, STEPS, EXPERTS, (0, 1), tmp_path / "one", tmp_path / "two"
    )
    assert any("shared_expert_gate" in name for name in one["adapter"])
