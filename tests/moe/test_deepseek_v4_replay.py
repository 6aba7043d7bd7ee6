"""Routing replay on DeepSeek-V4: a tiny random checkpoint of 3 MoE layers (the first hash-routed
by a token-to-expert table, the other two by the family's sqrt-softplus top-2 with a random bias
correction), 8 routed experts each and a shared expert (``build_deepseek_v4``, the expert
parallelism test's, with the bias added here).

Both routers weigh the experts as the family does (the scoring function of their logits,
renormalised, times ``routed_scaling_factor``); a replayed forward weighs the recorded experts the
same way. Checked against the routers' own output bit for bit at their own choice, and against a
float64 reference of that definition at other experts. A hash-routed layer applies the recorded
experts too: the recorded route is the table's choice for the same token, so replaying the
model's own or the sampler's routes reproduces the table, and routes that differ from the table
are run as given, like any other layer's."""

import sys
from pathlib import Path

import pytest
import torch
import transformers
from peft import LoraConfig

from twinkle.data_format import SamplingParams
from twinkle.model import TransformersModel
from twinkle.model.forward import causal_lm_of
from twinkle.model.router_replay import MOE_MODEL_TYPES, ROUTERS
from twinkle.model.transformers.moe.router_replay import RouterReplayAction
from twinkle.sampler import TorchSampler

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))  # the tiny DeepSeek-V4 builder
from test_ep_deepseek_v4 import build_deepseek_v4  # noqa: E402

RECORD, REPLAY = RouterReplayAction.RECORD, RouterReplayAction.REPLAY_FORWARD
EXPERTS, TOP_K, LAYERS, HASH = 8, 2, 3, 0  # the checkpoint's; layer 0 is the hash-routed one
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


def _routers(lm: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in lm.modules() if type(m).__name__ in ("DeepseekV4HashRouter", "DeepseekV4TopKRouter")]


@pytest.fixture(scope="module")
def checkpoint(tiny_model_dir, tmp_path_factory) -> Path:
    """The expert parallelism test's checkpoint, each top-k router with a random bias correction
    large enough to change some of its choices."""
    out = build_deepseek_v4(tiny_model_dir, tmp_path_factory.mktemp("replay-v4") / "deepseek_v4")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    for router in _routers(model):
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.copy_(0.05 * torch.randn(EXPERTS, generator=g))
    model.save_pretrained(out)
    return out


def _model(path: Path) -> TransformersModel:
    model = TransformersModel(model_id=str(path), dtype=torch.float32, enable_router_replay=True)
    torch.manual_seed(0)
    model.add_adapter_to_model(
        "default", LoraConfig(r=2, lora_alpha=4, target_modules=["q_b_proj", "o_b_proj"])
    )
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
    """The family's weights of ``chosen`` experts, in float64: sqrt(softplus(logit)), renormalised,
    times ``routed_scaling_factor``."""
    scores = torch.nn.functional.softplus(logits.double().gather(-1, chosen)).sqrt()
    return scores / scores.sum(dim=-1, keepdim=True) * router.routed_scaling_factor


def test_deepseek_v4_is_a_replayed_family():
    assert "deepseek_v4" in MOE_MODEL_TYPES
    assert {"DeepseekV4TopKRouter", "DeepseekV4HashRouter"} <= set(ROUTERS)


def test_replayed_weights_are_the_familys_own(checkpoint):
    lm = causal_lm_of(_model(checkpoint).model)
    routers = _routers(lm)
    assert [type(r).__name__ for r in routers] == ["DeepseekV4HashRouter"] + ["DeepseekV4TopKRouter"] * 2
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(64, 32, generator=g)
    ids = torch.randint(0, lm.config.vocab_size, (64,), generator=g)
    for router in routers:
        weigh = ROUTERS[type(router).__name__]
        with torch.no_grad():
            hashed = type(router).__name__ == "DeepseekV4HashRouter"
            logits, weights, experts = router(hidden, ids) if hashed else router(hidden)
            # at the router's own choice: its own weights, bit for bit
            assert torch.equal(weigh(router, logits, experts).to(weights.dtype), weights)
            # at other experts: the family's definition (float64), within fp32 rounding of a few ops
            other = (experts + 3) % EXPERTS
            got = weigh(router, logits, other)
            assert torch.allclose(got.double(), _reference(router, logits, other), rtol=16 * 2.0**-24, atol=0)
        if hashed:
            assert torch.equal(experts, router.tid2eid[ids])
            continue
        bias = router.e_score_correction_bias  # the bias correction changed some choices
        saved = bias.clone()
        with torch.no_grad():
            bias.zero_()
            unbiased = router(hidden)[2]
            bias.copy_(saved)
        assert not torch.equal(unbiased.sort(-1)[0], experts.sort(-1)[0])


def test_replay_routes_the_training_forward_through_the_recorded_experts(checkpoint):
    model = _model(checkpoint)  # the padded batch: DeepSeek-V4 is not a family packing runs
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
    # without replay the scored layers choose other experts for some tokens; the table does not move
    assert not torch.equal(moved[:, :, 1:][ran[:, :, 1:]], recorded[:, :, 1:][ran[:, :, 1:]])
    assert torch.equal(moved[:, :, HASH], recorded[:, :, HASH])
    loss = model.forward_backward(inputs=_with_routes(ROWS, recorded), router_replay_action=REPLAY)
    assert torch.equal(model.router_replay.recorded_routes(), recorded)  # every token and layer
    assert torch.isfinite(torch.tensor(float(loss)))
    model.clip_grad_and_step()


def test_the_hash_routed_layer_runs_the_recorded_experts_not_the_table(checkpoint):
    """Routes other than the table's (every layer's experts shifted by 3) are run as given at the
    hash-routed layer too, and change what the model computes there."""
    model = _model(checkpoint)
    recorded = model.forward_only(inputs=ROWS, router_replay_action=RECORD)["routed_experts"]
    ran = recorded >= 0
    only_hash = recorded.clone()
    only_hash[:, :, HASH] = torch.where(
        ran[:, :, HASH], (recorded[:, :, HASH] + 3) % EXPERTS, recorded[:, :, HASH]
    )
    before = model.forward_only(inputs=_with_routes(ROWS, recorded), router_replay_action=REPLAY)
    after = model.forward_only(inputs=_with_routes(ROWS, only_hash), router_replay_action=REPLAY)
    assert torch.equal(after["routed_experts"], only_hash)
    assert not torch.equal(after["logps"], before["logps"])


def test_the_sampler_records_the_routes_training_replays(checkpoint):
    model = _model(checkpoint)
    table = _routers(causal_lm_of(model.model))[HASH].tid2eid
    sampler = TorchSampler(model, engine_args={"enable_return_routed_experts": True})
    prompts = [list(range(20, 32)) + [40, 41], list(range(20, 28))]
    responses = sampler.sample(
        [{"input_ids": p} for p in prompts], SamplingParams(max_tokens=5, num_samples=2, seed=0)
    )
    rows, routes = [], []
    for prompt, response in zip(prompts, responses, strict=True):
        for seq in response.sequences:
            # every token the model ran: the prompt and each sampled token but the last
            ran = prompt + list(seq.tokens)[:-1]
            assert seq.routed_experts.shape == (len(ran), LAYERS, TOP_K)
            # the hash-routed layer's route is the table's choice for each token
            assert torch.equal(torch.as_tensor(seq.routed_experts)[:, HASH], table[torch.tensor(ran)])
            rows.append(seq.new_input_feature)
            routes.append(torch.as_tensor(seq.routed_experts))
    _shift(causal_lm_of(model.model))
    model.forward_backward(inputs=rows, router_replay_action=REPLAY)
    chosen = model.router_replay.recorded_routes()
    for i, r in enumerate(routes):
        assert torch.equal(chosen[i, : r.shape[0]], r)  # every token the sampler ran, every layer
