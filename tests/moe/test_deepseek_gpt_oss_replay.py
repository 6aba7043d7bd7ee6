"""Routing replay on DeepSeek-V3 (group-limited top-k over sigmoid scores with a bias correction,
``routed_scaling_factor``) and gpt-oss (top-k over a linear with a bias, a softmax over the
chosen): a forward armed with recorded routes runs every token through exactly the recorded
experts, and weighs them as the family weighs the experts it chooses itself; the sampler records
the routes its tokens were drawn with, and training replays them.

The weights are checked twice: against the router's own output, bit for bit, where the replayed
experts are the router's choice (directly on a router, and as a whole model whose replayed
log-probabilities equal its plain ones exactly); and against a float64 reference of the family's
definition at experts the router did not choose. The DeepSeek checkpoints carry a bias
correction that changes some choices, so a weight that read the biased score would differ."""

import json
from pathlib import Path

import pytest
import torch
import transformers
from peft import LoraConfig

from twinkle.data_format import SamplingParams
from twinkle.model import TransformersModel
from twinkle.model.forward import causal_lm_of
from twinkle.model.router_replay import ROUTERS
from twinkle.model.transformers.moe.router_replay import RouterReplayAction
from twinkle.sampler import TorchSampler

RECORD, REPLAY = RouterReplayAction.RECORD, RouterReplayAction.REPLAY_FORWARD
EXPERTS, TOP_K, LAYERS = 8, 2, 2
ROWS = [
    {"messages": [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "Twinkle."}]},
    {
        "messages": [
            {"role": "user", "content": "Your name, please?"},
            {"role": "assistant", "content": "I am Twinkle, a helpful assistant made by Acme."},
        ]
    },
    {"messages": [{"role": "user", "content": "Paris?"}, {"role": "assistant", "content": "France"}]},
]
SHAPE = dict(
    hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4, max_position_embeddings=512,
    num_experts_per_tok=TOP_K, tie_word_embeddings=True,
)  # fmt: skip


def _ids(tiny_model_dir: Path) -> dict:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    return {k: config.get(k) for k in ("vocab_size", "eos_token_id", "pad_token_id")}


def _save(model: torch.nn.Module, tiny_model_dir: Path, out: Path) -> Path:
    model.save_pretrained(out)
    for path in tiny_model_dir.iterdir():
        if "token" in path.name or path.suffix == ".jinja":
            (out / path.name).write_bytes(path.read_bytes())
    return out


def _routers(lm: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in lm.modules() if type(m).__name__ in ("DeepseekV3TopkRouter", "GptOssTopKRouter")]


def build_deepseek_v3(tiny_model_dir: Path, out: Path, norm_topk_prob: bool = True) -> Path:
    """2 MoE layers of 8 routed experts (2 groups of 4, one kept; top-2) and a shared expert; each
    router's bias correction random, large enough to change some choices."""
    config = transformers.DeepseekV3Config(
        **SHAPE, **_ids(tiny_model_dir), num_key_value_heads=4, intermediate_size=64,
        moe_intermediate_size=16, first_k_dense_replace=0, n_routed_experts=EXPERTS, n_shared_experts=1,
        n_group=2, topk_group=1, norm_topk_prob=norm_topk_prob, routed_scaling_factor=2.5,
        q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config)
    g = torch.Generator().manual_seed(2)
    for router in _routers(model):
        router.weight.data.normal_(0.0, 0.5, generator=g)  # HF leaves it zero until trained
        router.e_score_correction_bias.copy_(0.1 * torch.randn(EXPERTS, generator=g))
    return _save(model, tiny_model_dir, out)


def build_gpt_oss(tiny_model_dir: Path, out: Path) -> Path:
    """2 layers (sliding, then full attention), each 8 experts top-2."""
    config = transformers.GptOssConfig(
        **SHAPE, **_ids(tiny_model_dir), num_key_value_heads=2, head_dim=8, num_local_experts=EXPERTS,
        intermediate_size=16,
    )  # fmt: skip
    torch.manual_seed(0)
    return _save(transformers.GptOssForCausalLM(config), tiny_model_dir, out)


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("replay-families")
    return {
        "deepseek_v3": build_deepseek_v3(tiny_model_dir, root / "deepseek_v3"),
        "deepseek_v3-plain": build_deepseek_v3(
            tiny_model_dir, root / "deepseek_v3-plain", norm_topk_prob=False
        ),
        "gpt_oss": build_gpt_oss(tiny_model_dir, root / "gpt_oss"),
    }


def _model(path: Path) -> TransformersModel:
    model = TransformersModel(model_id=str(path), dtype=torch.float32, enable_router_replay=True)
    torch.manual_seed(0)
    model.add_adapter_to_model("default", LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "o_proj"]))
    model.set_optimizer("AdamW", lr=1e-3)
    return model


def _shift(lm: torch.nn.Module) -> None:
    """Move every router's weights (a step between sampling and training, made large)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for router in _routers(lm):
            router.weight.add_(torch.randn(router.weight.shape, generator=g))


def _with_routes(rows, routes):
    return [dict(row, routed_experts=r) for row, r in zip(rows, routes, strict=True)]


def _reference(router: torch.nn.Module, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The family's weights of ``chosen`` experts, in float64, from its definition."""
    at = logits.double().gather(-1, chosen)
    if type(router).__name__ == "GptOssTopKRouter":
        return torch.softmax(at, dim=-1)
    weights = at.sigmoid()
    if router.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * router.routed_scaling_factor


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v3-plain", "gpt_oss"])
def test_replayed_weights_are_the_familys_own(checkpoints, family):
    lm = causal_lm_of(_model(checkpoints[family]).model)
    router = _routers(lm)[0]
    weigh = ROUTERS[type(router).__name__]
    hidden = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, weights, experts = router(hidden)
        # at the router's own choice: its own weights, bit for bit
        assert torch.equal(weigh(router, logits, experts).to(weights.dtype), weights)
        # at other experts: the family's definition (float64), within fp32 rounding of a few ops
        other = (experts + 3) % EXPERTS
        expected = _reference(router, logits, other)
        got = weigh(router, logits, other)
        assert torch.allclose(got.double(), expected, rtol=16 * 2.0**-24, atol=0)
    if family.startswith("deepseek"):  # the bias correction changed some choices
        bias = router.e_score_correction_bias
        saved = bias.clone()
        with torch.no_grad():
            bias.zero_()
            unbiased = router(hidden)[2]
            bias.copy_(saved)
        assert not torch.equal(unbiased.sort(-1)[0], experts.sort(-1)[0])


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v3-plain", "gpt_oss"])
def test_replay_routes_the_training_forward_through_the_recorded_experts(checkpoints, family):
    model = _model(checkpoints[family])  # the padded batch: neither family is one packing runs
    plain = model.forward_only(inputs=ROWS)["logps"]
    recorded = model.forward_only(inputs=ROWS, router_replay_action=RECORD)["routed_experts"]
    assert recorded.shape[2:] == (LAYERS, TOP_K) and bool((recorded >= 0).any())
    # the model's own routes replayed: the same weights, so the same log-probabilities, exactly
    again = model.forward_only(inputs=_with_routes(ROWS, recorded), router_replay_action=REPLAY)
    assert torch.equal(again["logps"], plain)
    assert torch.equal(again["routed_experts"], recorded)

    _shift(causal_lm_of(model.model))  # the policy moved between sampling and training
    moved = model.forward_only(inputs=ROWS, router_replay_action=RECORD)["routed_experts"]
    ran = recorded >= 0
    assert not torch.equal(moved[ran], recorded[ran])  # without replay, other experts for some tokens
    loss = model.forward_backward(inputs=_with_routes(ROWS, recorded), router_replay_action=REPLAY)
    assert torch.equal(model.router_replay.recorded_routes(), recorded)  # every token and layer
    assert torch.isfinite(torch.tensor(float(loss)))
    model.clip_grad_and_step()


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_the_sampler_records_the_routes_training_replays(checkpoints, family):
    model = _model(checkpoints[family])
    sampler = TorchSampler(model, engine_args={"enable_return_routed_experts": True})
    prompts = [list(range(20, 32)) + [40, 41], list(range(20, 28))]
    responses = sampler.sample(
        [{"input_ids": p} for p in prompts], SamplingParams(max_tokens=5, num_samples=2, seed=0)
    )
    rows, routes = [], []
    for prompt, response in zip(prompts, responses, strict=True):
        for seq in response.sequences:
            # every token the model ran: the prompt and each sampled token but the last
            assert seq.routed_experts.shape == (len(prompt) + len(seq.tokens) - 1, LAYERS, TOP_K)
            rows.append(seq.new_input_feature)
            routes.append(seq.routed_experts)
    _shift(causal_lm_of(model.model))
    model.forward_backward(inputs=rows, router_replay_action=REPLAY)
    chosen = model.router_replay.recorded_routes()
    for i, r in enumerate(routes):
        ran = chosen[i, : r.shape[0]] >= 0
        assert bool(ran.any())
        assert torch.equal(chosen[i, : r.shape[0]][ran], r[ran])
