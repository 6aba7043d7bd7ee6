"""The attention layers' q/k/v projections and rotary embedding as one LoRA node equal Hugging
Face's attention forward run layer by layer (outputs and every gradient), and anything the node
does not cover runs the class's own forward."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from tiny import TINY_LLAMA_SHAPE
from tolerances import assert_within, chain_tolerances, gamma, tiny_llama_sums
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from twinkle.kernel import KernelChoice, kernelize, set_switches
from twinkle.kernel.lora import qkv as lora_qkv
from twinkle.kernel.lora.linear import fuse_lora_linears

FAMILIES = {
    "Llama": (LlamaConfig, LlamaForCausalLM),
    "Mistral": (MistralConfig, MistralForCausalLM),
    "Qwen2": (Qwen2Config, Qwen2ForCausalLM),
}


def _pair(family="Llama", dropout=0.0, targets="all-linear", attn="sdpa", **overrides):
    """One LoRA model twice: as PEFT leaves it (each layer a one-node LoRA layer, as Twinkle runs
    them), and with its attention layers kernelized."""
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(0)
    config = config_cls(**(dict(TINY_LLAMA_SHAPE, vocab_size=100) | overrides))
    config._attn_implementation = attn
    model = model_cls(config)
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, lora_dropout=dropout, init_lora_weights=False
    )
    layers = get_peft_model(model, lora)
    fuse_lora_linears(layers)
    mapping = {f"{family}Attention": KernelChoice("lora_attention", ("torch",))}
    return layers, kernelize(copy.deepcopy(layers), mapping)


def _run(model, ids, embeds_grad=True):
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(embeds_grad)
    out = model(inputs_embeds=embeds, use_cache=False).logits  # as in training: no KV cache
    out.square().sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out, embeds.grad, grads


def _assert_close(a, b):
    out_a, gx_a, grads_a = a
    out_b, gx_b, grads_b = b
    # the node sums q's, k's and v's terms (and their adapters') in other orders than the layers:
    # each tensor within the tiny Llama's chain of fp32 sums, plus out^2's gradient, scaled to
    # the tensor (tolerances.py, ~2e-4 of it); a wrong mask or a missing adapter moves a tensor
    # by ~1e-1 of its scale
    sums = tiny_llama_sums(out_a.shape[1], out_a.shape[-1]) + [2]
    torch.testing.assert_close(out_b, out_a, **chain_tolerances(sums, out_a))
    assert (gx_a is None) == (gx_b is None)
    if gx_a is not None:
        torch.testing.assert_close(gx_b, gx_a, **chain_tolerances(sums, gx_a))
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, **chain_tolerances(sums, grad), msg=name)


def _count_node_calls(monkeypatch):
    calls = []
    real = lora_qkv._LoraQKV.apply
    monkeypatch.setattr(lora_qkv._LoraQKV, "apply", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("family", list(FAMILIES))
def test_node_equals_the_layers(family, monkeypatch):
    extra = {"attention_bias": True} if family == "Llama" else {}  # Qwen2 has q/k/v biases already
    layers, node = _pair(family, **extra)
    calls = _count_node_calls(monkeypatch)
    ids = torch.randint(0, 100, (2, 11))
    expected = _run(layers, ids)
    assert not calls
    got = _run(node, ids)
    assert len(calls) == TINY_LLAMA_SHAPE["num_hidden_layers"]  # every layer took the node
    _assert_close(expected, got)


def test_ungrouped_heads_and_a_frozen_input():
    layers, node = _pair(num_key_value_heads=4)
    ids = torch.randint(0, 100, (1, 9))
    _assert_close(_run(layers, ids, embeds_grad=False), _run(node, ids, embeds_grad=False))


def test_adapters_on_some_projections_only_run_the_layers(monkeypatch):
    layers, node = _pair(targets=["q_proj", "v_proj", "o_proj"])
    calls = _count_node_calls(monkeypatch)
    ids = torch.randint(0, 100, (1, 7))
    _assert_close(_run(layers, ids), _run(node, ids))
    assert not calls  # k_proj is a plain nn.Linear: no node


def test_with_an_active_dropout_the_node_equals_the_layers_drawing_the_same_masks(monkeypatch):
    layers, node = _pair(dropout=0.1)
    layers.train()
    node.train()
    calls = _count_node_calls(monkeypatch)
    ids = torch.randint(0, 100, (1, 7))
    torch.manual_seed(1)
    expected = _run(layers, ids)
    torch.manual_seed(1)
    got = _run(node, ids)
    assert calls  # the node ran, with the masks
    _assert_close(expected, got)
    torch.manual_seed(2)
    assert not torch.allclose(_run(node, ids)[0], got[0])  # the masks are really random


@pytest.mark.parametrize("case", ["eager", "switched off"])
def test_what_the_node_does_not_cover_runs_the_class_forward(case, monkeypatch):
    layers, node = _pair(attn="eager" if case == "eager" else "sdpa")
    if case == "switched off":
        set_switches({"TWINKLE_LORA_QKV": "off"})
    layers.train()
    node.train()
    calls = _count_node_calls(monkeypatch)
    ids = torch.randint(0, 100, (1, 7))
    torch.manual_seed(1)
    expected = _run(layers, ids)
    torch.manual_seed(1)
    got = _run(node, ids)
    assert not calls
    _assert_close(expected, got)


def test_generation_with_a_cache_runs_the_class_forward():
    layers, node = _pair()
    ids = torch.randint(0, 100, (1, 5))
    with torch.no_grad():
        a = layers.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
        b = node.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(a, b)


def test_an_unknown_attention_class_keeps_its_forward():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = Qwen3ForCausalLM(Qwen3Config(**dict(TINY_LLAMA_SHAPE, vocab_size=100, head_dim=8)))
    kernelize(model, {"Qwen3Attention": KernelChoice("lora_attention", ("torch",))})
    attention = model.model.layers[0].self_attn
    assert "forward" not in vars(attention)  # q_norm/k_norm sit between projection and rotation


def test_rotation_and_its_gradient_equal_hugging_faces():
    torch.manual_seed(0)
    q = torch.randn(2, 5, 3, 8, requires_grad=True)  # (batch, tokens, heads, head_dim)
    k = torch.randn(2, 5, 1, 8, requires_grad=True)
    angles = torch.randn(2, 5, 4)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    flat_cos, flat_sin = cos.reshape(10, 1, 8), sin.reshape(10, 1, 8)
    got_q = lora_qkv.rotate(q.detach().reshape(10, 3, 8), flat_cos, flat_sin)
    # x cos + rotate_half(x) sin: two products and a sum per element, each rounded (gamma(3) of
    # its terms' magnitudes) against the float64 rotation; a wrong half, sign or angle is off
    # by about a term
    exact_q, _ = apply_rotary_pos_emb(
        q.double().transpose(1, 2), k.double().transpose(1, 2), cos.double(), sin.double()
    )
    assert_within(got_q, _flat(exact_q), _flat(_rotation_terms(q.transpose(1, 2), cos, sin)), "rotate")
    g = torch.randn(2, 3, 5, 8)
    (ref_q * g).sum().backward()
    grad = lora_qkv.unrotate(g.transpose(1, 2).reshape(10, 3, 8), flat_cos, flat_sin)
    q64 = q.detach().double().requires_grad_()
    exact, _ = apply_rotary_pos_emb(
        q64.transpose(1, 2), k.double().transpose(1, 2), cos.double(), sin.double()
    )
    (exact * g.double()).sum().backward()
    # the transposed rotation: g cos, and g sin moved back to the other half (the same terms)
    terms = (g * cos[:, None]).abs() + _swap_halves((g * sin[:, None]).abs())
    assert_within(grad, q64.grad.reshape(10, 3, 8), gamma(3) * _flat(terms.double()), "unrotate")


def _flat(t: torch.Tensor) -> torch.Tensor:
    """(batch, heads, tokens, dim) -> (batch * tokens, heads, dim), as the node lays them out."""
    return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[-1])


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([x[..., half:], x[..., :half]], -1)


def _rotation_terms(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """gamma(3) times |x cos| + |rotate_half(x) sin|, in float64: the rotation's worst fp32 error."""
    x, cos, sin = x.detach().double(), cos[:, None].double(), sin[:, None].double()
    return gamma(3) * ((x * cos).abs() + (_swap_halves(x) * sin).abs())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_pass_without_the_node_rotates_as_it_does_and_equals_the_class_forward(family, monkeypatch):
    """With the adapters off and no gradient (a reference pass), the node does not run; the
    layers' products are rotated by ``rotate`` as the node rotates them, and the logits equal
    the class's own forward within the tiny model's chain of fp32 sums."""
    layers, node = _pair(family)
    layers.eval()
    node.eval()
    rotated = []
    real = lora_qkv.rotated_projections
    monkeypatch.setattr(
        "twinkle.kernel.backends.torch_ops.rotated_projections",
        lambda *a: rotated.append(1) or real(*a),
    )
    calls = _count_node_calls(monkeypatch)
    ids = torch.randint(0, 100, (2, 7))
    with torch.no_grad(), layers.disable_adapter(), node.disable_adapter():
        expected = layers(input_ids=ids, use_cache=False).logits
        got = node(input_ids=ids, use_cache=False).logits
    assert not calls and len(rotated) == TINY_LLAMA_SHAPE["num_hidden_layers"]
    torch.testing.assert_close(got, expected, **chain_tolerances(tiny_llama_sums(7, 100), expected))
    with torch.no_grad():  # adapters on: the node, not this path
        node(input_ids=ids, use_cache=False)
    assert calls and len(rotated) == TINY_LLAMA_SHAPE["num_hidden_layers"]
