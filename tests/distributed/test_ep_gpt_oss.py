"""Expert parallelism on gpt-oss, on 2 gloo ranks (ep_size 2 over 2 FSDP2 shards), equals one
process: a tiny random checkpoint of 2 layers (sliding, then full attention, with sinks), each 8
experts top-2 behind the family's biased linear router and its softmax over the chosen.

gpt-oss's experts differ from the Qwen families' in three ways the exchange must follow: the
weights are stored transposed (``gate_up_proj`` (experts, hidden, 2 * intermediate), ``down_proj``
(experts, intermediate, hidden)), each projection adds a per-expert bias (sliced into the rank's
block like the weights, and left out of FSDP2 with them), and the activation clamps interleaved
gate/up columns to ``swiglu_limit`` and computes ``(up + 1) * gate * sigmoid(alpha * gate)``. The
checkpoint's expert weights and biases are drawn large and its limit made small, so the clamp
acts on many entries and the biases matter.

``ep_worker.py`` runs 3 LoRA steps on 4 chat samples, LoRA on the attention and on the experts
(``target_parameters``, which PEFT maps onto the transposed layout); the per-step losses, gradient
norms and an evaluation pass's logps agree within ``run_loss_rtol``, the saved adapters within
``adamw_weight_atol``, and each rank holds exactly its own 4 of the 8 experts' weights and biases
of each layer. In one process, the exchange (over a group of one) gives the family's experts'
output on the same rows up to the rounding of a different row grouping, and a plain SwiGLU in its
place does not."""

import copy
import json
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from ep_runs import assert_ep_equals_one_process, run_ep_worker

from twinkle.distributed.expert_parallel import ExpertGroup
from twinkle.model.expert_parallel import _exchanging_forward, check_model

STEPS, LR, EXPERTS, TOP_K = 3, 1e-2, 8, 2  # as ep_worker.py runs them; the checkpoint's experts
SHAPE = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, intermediate_size=16, swiglu_limit=0.5,
    max_position_embeddings=512, tie_word_embeddings=True,
)  # fmt: skip


def _draw_experts(model: torch.nn.Module) -> None:
    """Expert weights and biases large enough that the clamp and the biases act (transformers
    draws the weights at std 0.02 and the biases zero)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == "GptOssExperts":
                for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
                    getattr(module, name).normal_(0.0, 0.3, generator=g)


def build_gpt_oss(tiny_model_dir: Path, out: Path) -> Path:
    ids = json.loads((tiny_model_dir / "config.json").read_text())
    config = transformers.GptOssConfig(
        **SHAPE, vocab_size=ids["vocab_size"], eos_token_id=ids.get("eos_token_id"),
        pad_token_id=ids.get("pad_token_id"),
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config)
    _draw_experts(model)
    model.save_pretrained(out)
    for path in tiny_model_dir.iterdir():
        if "token" in path.name or path.suffix == ".jinja":
            (out / path.name).write_bytes(path.read_bytes())
    return out


@pytest.mark.slow
@pytest.mark.cluster  # 2-process runs, with the other `-m cluster` suites
def test_gpt_oss_under_expert_parallelism_equals_one_process(tiny_model_dir, tmp_path, launcher):
    model_dir = build_gpt_oss(tiny_model_dir, tmp_path / "gpt_oss")
    one = run_ep_worker(launcher, model_dir, tmp_path / "one", 1, STEPS)
    two = run_ep_worker(launcher, model_dir, tmp_path / "two", 2, STEPS)
    assert_ep_equals_one_process(
        one, two, "gpt_oss", LR, STEPS, EXPERTS, (0, 1), tmp_path / "one", tmp_path / "two", biases=True
    )


def _plain_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def test_the_exchange_runs_gpt_oss_experts_as_the_family_does():
    config = transformers.GptOssConfig(**SHAPE)
    check_model(config, 2)  # a family expert parallelism runs
    torch.manual_seed(0)
    experts = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(config)
    for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
        torch.nn.init.normal_(getattr(experts, name), 0.0, 0.3)
    hidden = torch.randn(24, SHAPE["hidden_size"])
    scores, index = torch.randn(24, EXPERTS).topk(TOP_K, dim=-1)
    weights = scores.softmax(dim=-1)
    with torch.no_grad():
        expected = experts(hidden, index, weights)
        gate_up = torch.einsum("th,ehi->tei", hidden, experts.gate_up_proj) + experts.gate_up_proj_bias
    assert (gate_up.abs() > SHAPE["swiglu_limit"]).float().mean() > 0.3  # the clamp acts
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = ExpertGroup(1, 0, dist.new_group([0]))
        exchanged = copy.deepcopy(experts)
        exchanged.forward = types.MethodType(_exchanging_forward(group, EXPERTS), exchanged)
        plain = copy.deepcopy(exchanged)
        plain._apply_gate = _plain_swiglu
        with torch.no_grad():
            got, other = exchanged(hidden, index, weights), plain(hidden, index, weights)
    finally:
        if owned:
            dist.destroy_process_group()
    # the same products on other groupings of rows: sums of at most 2 * intermediate terms may
    # round otherwise, each within that many float32 epsilons of the sum of their magnitudes
    atol = 4 * SHAPE["intermediate_size"] * torch.finfo(torch.float32).eps * expected.abs().max().item()
    assert (got - expected).abs().max().item() <= atol
    assert (other - expected).abs().max().item() > 100 * atol
