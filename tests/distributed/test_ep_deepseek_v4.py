"""Expert parallelism on DeepSeek-V4, on 2 gloo ranks (ep_size 2 over 2 FSDP2 shards), equals one
process: a tiny random checkpoint of 3 layers (heavily compressed, compressed sparse and again
heavily compressed attention; the first MoE layer hash-routed by a fixed token-to-expert table,
the other two by the family's sqrt-softplus top-2), each of 8 routed experts whose SwiGLU clamps
gate and up to ``swiglu_limit`` (the experts' own ``_apply_gate``, which the exchanged experts
call), and a shared expert.

``ep_worker.py`` runs 3 LoRA steps on 4 chat samples, LoRA on the attention (q_b_proj, o_b_proj) and
on the experts (``target_parameters``); the shared comparison (``ep_runs.py``) checks losses,
gradient norms, logps, the saved adapters and each rank's block of experts. The clamp matters:
the experts' weights are scaled so that some gate products pass the limit, which a plain SwiGLU
in the exchange would compute otherwise (checked on the checkpoint before the runs).

``index_topk`` (64) is at least the number of compressed blocks a row has, so the compressed
sparse attention attends to every block that precedes a query. With fewer, the indexer's top-k
picks among blocks whose ReLU scores tie at 0, and which of them it keeps depends on the padded
length: the rows then give other logits batched 4 together (one process) than 2 (each rank)."""

import json
from pathlib import Path

import pytest
import torch
import transformers
from ep_runs import assert_ep_equals_one_process, run_ep_worker

from twinkle.model.expert_parallel import check_model, gated

pytestmark = [pytest.mark.slow, pytest.mark.cluster]  # 2-process runs, with the other `-m cluster` suites

STEPS, LR, EXPERTS = 3, 1e-2, 8  # as ep_worker.py runs them; the checkpoint's routed experts
LIMIT = 0.5  # swiglu_limit, small enough for the tiny model's gate products to reach it


def build_deepseek_v4(tiny_model_dir: Path, out: Path) -> Path:
    ids = json.loads((tiny_model_dir / "config.json").read_text())
    config = transformers.DeepseekV4Config(
        vocab_size=ids["vocab_size"], eos_token_id=ids.get("eos_token_id"), pad_token_id=ids.get("pad_token_id"),
        bos_token_id=ids.get("bos_token_id"), hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, q_lora_rank=16, qk_rope_head_dim=4,
        n_routed_experts=EXPERTS, num_experts_per_tok=2, n_shared_experts=1, swiglu_limit=LIMIT,
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"], o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=8,
        index_topk=64, sliding_window=16, hc_mult=2, max_position_embeddings=512, num_nextn_predict_layers=0,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(config)
    with torch.no_grad():
        # a random table of 2 distinct experts per token for the hash-routed layer (the
        # initialised table sends every token to expert 0 twice)
        table = torch.rand(config.vocab_size, EXPERTS).argsort(dim=1)[:, :2]
        model.model.layers[0].mlp.gate.tid2eid.copy_(table)
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj.mul_(5.0)  # gate products past swiglu_limit
    model.save_pretrained(out)
    for path in tiny_model_dir.iterdir():
        if "token" in path.name or path.suffix == ".jinja":
            (out / path.name).write_bytes(path.read_bytes())
    return out


def test_the_exchanged_experts_clamp_as_the_family_does(tiny_model_dir, tmp_path):
    """``gated`` is DeepSeek-V4's clamped SwiGLU, and on this checkpoint it differs from a plain
    one (so the equality below depends on it)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        build_deepseek_v4(tiny_model_dir, tmp_path / "v4")
    )
    experts = model.model.layers[1].mlp.experts
    hidden = torch.randn(64, 32)
    gate_up = torch.nn.functional.linear(hidden, experts.gate_up_proj[0].detach())
    assert torch.equal(gated(experts, gate_up), experts._apply_gate(gate_up))
    gate, up = gate_up.chunk(2, dim=-1)
    assert gate_up.abs().max() > LIMIT
    assert not torch.allclose(gated(experts, gate_up), experts.act_fn(gate) * up)
    check_model(model.config, 2)  # 8 experts split 2 ways: accepted


def test_deepseek_v4_under_expert_parallelism_equals_one_process(tiny_model_dir, tmp_path, launcher):
    model_dir = build_deepseek_v4(tiny_model_dir, tmp_path / "deepseek_v4")
    one = run_ep_worker(launcher, model_dir, tmp_path / "one", 1, STEPS)
    two = run_ep_worker(launcher, model_dir, tmp_path / "two", 2, STEPS)
    assert_ep_equals_one_process(
        one, two, "deepseek_v4", LR, STEPS, EXPERTS, (0, 1, 2), tmp_path / "one", tmp_path / "two"
    )
