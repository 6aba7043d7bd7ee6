"""Activation checkpointing: exact, per batch, automatic only when memory would not suffice."""

import pytest
import torch

import twinkle.model.activation_checkpointing as checkpointing
from twinkle.dataloader import DataLoader
from twinkle.model.activation_checkpointing import LayerCheckpointing, activation_bytes
from twinkle.utils.errors import UserError


def _step(make_model, batch, mode):
    model = make_model(init_lora_weights=False)
    model.checkpointing.mode = mode
    loss = model.forward_backward(inputs=batch)
    grads = {n: p.grad.clone() for n, p in model.model.named_parameters() if p.grad is not None}
    return loss, grads, model.checkpointing.active


def test_checkpointed_step_equals_the_plain_one(make_model, dataset):
    batch = next(iter(DataLoader(dataset, batch_size=4)))
    loss_off, grads_off, active_off = _step(make_model, batch, "off")
    loss_on, grads_on, active_on = _step(make_model, batch, "on")
    assert (active_off, active_on) == (False, True)
    assert loss_on == loss_off
    assert grads_on.keys() == grads_off.keys() and grads_on
    for name, grad in grads_off.items():
        torch.testing.assert_close(grads_on[name], grad, rtol=0, atol=0, msg=name)


def test_on_recomputes_each_layer_in_backward(make_model, dataset):
    model = make_model()
    layers = model.checkpointing.layers
    assert len(layers) == model.model.get_base_model().config.num_hidden_layers
    mlp_calls = []  # pre-hooks: a recompute stops early, before the last post-hooks would fire
    for layer in layers:
        layer.mlp.register_forward_pre_hook(lambda *_: mlp_calls.append(1))
    batch = next(iter(DataLoader(dataset, batch_size=2)))
    for mode, per_layer in (("off", 1), ("on", 2), ("off", 1)):
        mlp_calls.clear()
        model.checkpointing.mode = mode
        model.forward_backward(inputs=batch)
        assert len(mlp_calls) == per_layer * len(layers), mode
    with torch.no_grad():  # evaluation never recomputes
        model.checkpointing.mode = "on"
        mlp_calls.clear()
        model.forward_only(inputs=batch)
        assert len(mlp_calls) == len(layers)


def test_auto_turns_on_only_when_activations_would_not_fit(make_model, monkeypatch):
    model = make_model()
    assert model.checkpointing.mode == "auto"  # the default
    lm = model.model.get_base_model()
    need = activation_bytes(lm.config, 1000, torch.float32)
    monkeypatch.setattr(checkpointing, "available_bytes", lambda device: int(need / 0.8) + 10**6)
    assert not model.checkpointing.decide(1000, torch.device("cpu"))
    monkeypatch.setattr(checkpointing, "available_bytes", lambda device: need)
    assert model.checkpointing.decide(1000, torch.device("cpu"))
    assert not model.checkpointing.decide(10, torch.device("cpu"))  # a short batch: full speed again


def test_auto_reads_no_parameter_when_even_float64_activations_fit(make_model, monkeypatch):
    model = make_model()
    lm = model.model.get_base_model()
    need64 = activation_bytes(lm.config, 1000, torch.float64)

    def no_walk(*args, **kwargs):
        raise AssertionError("decide() walked the parameters")

    monkeypatch.setattr(lm, "parameters", no_walk)
    monkeypatch.setattr(checkpointing, "available_bytes", lambda device: int(need64 / 0.8) + 10**6)
    assert not model.checkpointing.decide(1000, torch.device("cpu"))
    # a float64 estimate that does not fit is not the answer: the walk decides (fp32 fits here)
    monkeypatch.setattr(checkpointing, "available_bytes", lambda device: need64)
    with pytest.raises(AssertionError, match="walked"):
        model.checkpointing.decide(1000, torch.device("cpu"))


def test_auto_counts_fp32_lora_inputs_on_a_bf16_base(make_model, monkeypatch):
    # fp32 adapters on a bf16 base keep fp32 copies of their inputs: estimate in fp32
    model = make_model()
    lm = model.model.get_base_model()
    for name, param in lm.named_parameters():
        if "lora_" not in name:
            param.data = param.data.to(torch.bfloat16)
    need_fp32 = activation_bytes(lm.config, 1000, torch.float32)
    monkeypatch.setattr(checkpointing, "available_bytes", lambda device: int(0.9 * need_fp32 / 0.8))
    assert model.checkpointing.decide(1000, torch.device("cpu"))  # a bf16 estimate would say it fits


def test_activation_estimate_matches_the_measured_scale():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30)
    per_token_layer = activation_bytes(config, 1, torch.float32) / 30
    assert 50_000 < per_token_layer < 65_000  # measured 55 KB on SmolLM2-135M (fp32)
    assert activation_bytes(config, 10, torch.bfloat16) * 2 == activation_bytes(config, 10, torch.float32)


def test_bad_mode_is_a_user_error(make_model):
    model = make_model()
    with pytest.raises(UserError, match="auto, on, off"):
        LayerCheckpointing(model.model, "sometimes")
