"""Routing replay: a forward armed with recorded routes runs every token through exactly the
recorded experts, whatever the router would choose now; the sampler records the routes its
tokens were drawn with, in the layout training replays them; a model without routers refuses
in one line."""

import pytest
import torch
from peft import LoraConfig
from tiny_moe import TOP_K, shift_routers

from twinkle.data_format import SamplingParams
from twinkle.model import TransformersModel
from twinkle.model.forward import causal_lm_of
from twinkle.model.packing import pack
from twinkle.model.transformers.moe.router_replay import RouterReplayAction
from twinkle.sampler import TorchSampler
from twinkle.utils.errors import UserError

RECORD, REPLAY = RouterReplayAction.RECORD, RouterReplayAction.REPLAY_FORWARD
ROWS = [
    {"messages": [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "Twinkle."}]},
    {
        "messages": [
            {"role": "user", "content": "Your name, please?"},
            {"role": "assistant", "content": "I am Twinkle"},
        ]
    },
    {"messages": [{"role": "user", "content": "Paris?"}, {"role": "assistant", "content": "France"}]},
]
LAYERS = 2


def _model(path, padding_free=True) -> TransformersModel:
    model = TransformersModel(model_id=str(path), padding_free=padding_free, enable_router_replay=True)
    torch.manual_seed(0)
    model.add_adapter_to_model("default", LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))
    model.set_optimizer("AdamW", lr=1e-3)
    return model


def _with_routes(rows, routes):
    return [dict(row, routed_experts=r) for row, r in zip(rows, routes, strict=True)]


@pytest.fixture(params=["qwen3_moe-packed", "qwen3_moe-padded", "qwen3_5_moe-padded", "qwen2_moe-packed"])
def case(request):
    family, layout = request.param.split("-")
    return request.getfixturevalue(f"{family}_dir"), layout == "packed"


def test_replay_routes_the_training_forward_through_the_recorded_experts(case):
    path, padding_free = case
    model = _model(path, padding_free)
    recorded = model.forward_only(inputs=ROWS, router_replay_action=RECORD)["routed_experts"]
    rows, length = recorded.shape[:2]
    assert recorded.shape == (len(ROWS), length, LAYERS, TOP_K)
    assert bool((recorded >= 0).any()) and int(recorded.max()) < 8

    shift_routers(causal_lm_of(model.model))  # the policy moved between sampling and training
    moved = model.forward_only(inputs=ROWS, router_replay_action=RECORD)["routed_experts"]
    ran = recorded >= 0
    assert not torch.equal(moved[ran], recorded[ran])  # without replay, other experts for some tokens

    loss = model.forward_backward(inputs=_with_routes(ROWS, recorded), router_replay_action=REPLAY)
    chosen = model.router_replay.recorded_routes()  # the experts the training forward ran
    assert torch.equal(chosen, recorded)  # exactly the recorded ones, every token and layer
    assert torch.isfinite(torch.tensor(float(loss)))
    model.clip_grad_and_step()


def test_a_layer_recomputed_in_backward_replays_the_same_routes(qwen3_moe_dir):
    """Activation checkpointing runs each layer again in backward: the routes armed for the
    forward hold there too, so the checkpointed step's gradients are the plain step's."""
    grads = {}
    for mode in ("off", "on"):
        model = _model(qwen3_moe_dir)
        recorded = model.forward_only(inputs=ROWS, router_replay_action=RECORD)["routed_experts"]
        shift_routers(causal_lm_of(model.model))
        model.checkpointing.mode = mode
        model.forward_backward(inputs=_with_routes(ROWS, recorded), router_replay_action=REPLAY)
        assert model.checkpointing.active == (mode == "on")
        grads[mode] = {n: p.grad.clone() for n, p in model.model.named_parameters() if p.grad is not None}
    assert grads["on"].keys() == grads["off"].keys() and grads["on"]
    for name, grad in grads["off"].items():
        torch.testing.assert_close(grads["on"][name], grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])  # renormalised, and not
def test_replaying_a_models_own_routes_changes_nothing(request, family):
    """Replayed weights are the router's own softmax at the same experts, renormalised as the
    family does: replaying the routes the model chooses gives bit-identical log-probabilities."""
    model = _model(request.getfixturevalue(f"{family}_dir"))
    plain = model.forward_only(inputs=ROWS)["logps"]
    recorded = model.forward_only(inputs=ROWS, router_replay_action=RECORD)["routed_experts"]
    replayed = model.forward_only(inputs=_with_routes(ROWS, recorded), router_replay_action=REPLAY)
    assert torch.equal(replayed["logps"], plain)
    assert torch.equal(replayed["routed_experts"], recorded)


def test_forward_only_in_parts_records_every_row(qwen3_moe_dir):
    model = _model(qwen3_moe_dir)
    whole = model.forward_only(inputs=ROWS, router_replay_action=RECORD)["routed_experts"]
    parts = model.forward_only(inputs=ROWS, router_replay_action=RECORD, micro_batch_size=1)["routed_experts"]
    ran = (whole >= 0) & (parts >= 0)
    assert parts.shape == whole.shape and bool(ran.any())
    assert torch.equal(parts[ran], whole[ran])


def test_the_sampler_records_the_routes_training_replays(qwen3_moe_dir):
    model = _model(qwen3_moe_dir)
    sampler = TorchSampler(model, engine_args={"enable_return_routed_experts": True})
    prefix = list(range(20, 32))  # shared by every prompt: the decoder runs it once, apart
    prompts = [prefix + [40, 41, 42], prefix + [50], prefix + [60, 61]]
    params = SamplingParams(max_tokens=6, num_samples=2, seed=0)
    responses = sampler.sample([{"input_ids": p} for p in prompts], params)
    rows, routes = [], []
    for prompt, response in zip(prompts, responses, strict=True):
        for seq in response.sequences:
            # every token the model ran: the prompt and each sampled token but the last
            assert seq.routed_experts.shape == (len(prompt) + len(seq.tokens) - 1, LAYERS, TOP_K)
            assert seq.new_input_feature["routed_experts"] == seq.routed_experts.tolist()
            rows.append(seq.new_input_feature)
            routes.append(seq.routed_experts)

    # the sampler's routes are those a full forward of the same rows chooses (fp32, no ties)
    again = model.forward_only(
        inputs=[{k: v for k, v in r.items() if k != "routed_experts"} for r in rows],
        router_replay_action=RECORD,
    )["routed_experts"]
    shift_routers(causal_lm_of(model.model))
    model.forward_backward(inputs=rows, router_replay_action=REPLAY)
    chosen = model.router_replay.recorded_routes()
    for i, r in enumerate(routes):
        n = r.shape[0]
        ran = chosen[i, :n] >= 0
        assert bool(ran.any())
        assert torch.equal(chosen[i, :n][ran], r[ran])
        both = again[i, :n] >= 0
        assert torch.equal(again[i, :n][both], r[both])


def test_packing_lays_each_position_where_its_route_goes():
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(1, 64, (6,), generator=g).tolist()
    rows = [prefix + torch.randint(1, 64, (n,), generator=g).tolist() for n in (5, 3, 8)]
    width = max(map(len, rows))
    batch = {
        k: torch.zeros(3, width, dtype=torch.long) for k in ("input_ids", "attention_mask", "position_ids")
    }
    batch["labels"] = torch.full((3, width), -100)
    for i, row in enumerate(rows):
        batch["input_ids"][i, : len(row)] = torch.tensor(row)
        batch["attention_mask"][i, : len(row)] = 1
        batch["position_ids"][i, : len(row)] = torch.arange(len(row))
        batch["labels"][i, 7 : len(row)] = torch.tensor(row[7:])
    packed = pack(batch)
    where = packed["where"]
    kept = where >= 0
    assert packed["twinkle_segments"].prefix == 6  # the shared prefix is held once
    assert torch.equal(packed["input_ids"][0, where[kept]], batch["input_ids"][kept])
    assert set(where[kept].tolist()) == set(range(packed["input_ids"].shape[1]))


def test_replay_without_routes_or_with_routes_of_another_batch_is_one_line(qwen3_moe_dir):
    model = _model(qwen3_moe_dir)
    with pytest.raises(
        UserError, match="router_replay_action=REPLAY_FORWARD, but the batch has no routed_experts"
    ) as info:
        model.forward_backward(inputs=ROWS, router_replay_action=REPLAY)
    assert "\n" not in str(info.value)
    wrong = [torch.zeros(4, LAYERS + 1, TOP_K, dtype=torch.long) for _ in ROWS]
    with pytest.raises(
        UserError, match=r"routed_experts has shape .* \(rows, length, MoE layers, top-k\)"
    ) as info:
        model.forward_backward(inputs=_with_routes(ROWS, wrong), router_replay_action=REPLAY)
    assert "\n" not in str(info.value)


def test_replay_or_recorded_routes_on_a_dense_model_is_one_line(tiny_model_dir):
    with pytest.raises(
        UserError, match=r"enable_router_replay=True: the model \(llama\) has no mixture-of-experts router"
    ) as info:
        TransformersModel(model_id=str(tiny_model_dir), enable_router_replay=True)
    assert "\n" not in str(info.value)
    with pytest.raises(UserError, match="engine_args enable_return_routed_experts=True: the model") as info:
        TorchSampler(str(tiny_model_dir), engine_args={"enable_return_routed_experts": True})
    assert "\n" not in str(info.value)
