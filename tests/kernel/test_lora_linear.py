"""The one-node LoRA linear layer equals PEFT's, and steps aside where it does not apply."""

import copy
import pickle

import pytest
import torch
from allocations import peak_bytes
from masks import record, replay
from nets import TwoLinear
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from tolerances import chain_tolerances, rounding_tolerances
from torch import nn

from twinkle.kernel.lora.linear import FusedLoraLinear, fuse_lora_linears, lora_linear


def _pair(**lora):
    """The same LoRA model twice: PEFT's forward and the fused one."""
    torch.manual_seed(0)
    config = LoraConfig(r=3, lora_alpha=6, target_modules=["up", "down"], init_lora_weights=False, **lora)
    peft_model = get_peft_model(TwoLinear(), config)
    fused = copy.deepcopy(peft_model)
    assert fuse_lora_linears(fused) == 2
    return peft_model, fused


def _sums(x: torch.Tensor, width: int = 6, hidden: int = 10, r: int = 3) -> list[int]:
    """The fp32 sums along ``TwoLinear``'s LoRA forward and backward: each layer's base (its input
    width, + bias) and adapter (input width, then r) summed with a scaled branch, the backward's
    transposed products the same, and a weight gradient over the tokens of ``x``."""
    tokens = x.numel() // x.shape[-1]
    return [width + r + 4, hidden + r + 3, 1, hidden + r + 3, width + r + 3, tokens]


def _close(actual, expected, x, name=""):
    """Fused and PEFT sum the same fp32 terms in other orders: within the first-order bound of
    ``_sums`` (~8e-6 relative to the tensor's scale, tolerances.py); a dropped adapter, a wrong
    scaling or a mask on the wrong input moves elements by a fraction of the scale."""
    torch.testing.assert_close(actual, expected, **chain_tolerances(_sums(x), expected), msg=name or None)


def _run(model, x):
    x = x.clone().requires_grad_()
    out = model(x)
    out.square().sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out, x.grad, grads


def test_fused_equals_peft_in_outputs_and_gradients():
    peft_model, fused = _pair()
    assert isinstance(fused.base_model.model.up, FusedLoraLinear)
    x = torch.randn(2, 5, 6)
    out_ref, gx_ref, grads_ref = _run(peft_model, x)
    out, gx, grads = _run(fused, x)
    _close(out, out_ref, x)
    _close(gx, gx_ref, x)
    assert grads.keys() == grads_ref.keys() and len(grads) == 4  # lora_A and lora_B of both layers
    for name, grad in grads_ref.items():
        _close(grads[name], grad, x, name)


def test_frozen_base_gets_gradients_when_trainable():
    peft_model, fused = _pair()
    for model in (peft_model, fused):
        model.base_model.model.up.base_layer.weight.requires_grad_(True)
        model.base_model.model.up.base_layer.bias.requires_grad_(True)
    x = torch.randn(4, 6)
    _, _, grads_ref = _run(peft_model, x)
    _, _, grads = _run(fused, x)
    for name in ("base_model.model.up.base_layer.weight", "base_model.model.up.base_layer.bias"):
        _close(grads[name], grads_ref[name], x, name)


def test_dropout_gives_peft_gradients_given_the_same_masks(monkeypatch):
    peft_model, fused = _pair(lora_dropout=0.5)
    x = torch.randn(4, 3, 6)
    drawn = record(monkeypatch)
    out, gx, grads = _run(fused, x)
    assert len(drawn) == 2  # one mask per adapter call
    queue = replay(peft_model, drawn)
    out_ref, gx_ref, grads_ref = _run(peft_model, x)
    assert not queue
    _close(out, out_ref, x)
    _close(gx, gx_ref, x)
    for name, grad in grads_ref.items():
        _close(grads[name], grad, x, name)
    torch.manual_seed(2)
    assert not torch.allclose(fused(x), out)  # the masks are really random


def test_eval_mode_draws_no_mask(monkeypatch):
    peft_model, fused = _pair(lora_dropout=0.5)
    fused.eval()
    peft_model.eval()
    drawn = record(monkeypatch)
    x = torch.randn(4, 3, 6)
    state = torch.get_rng_state()
    out = fused(x)
    assert not drawn and torch.equal(torch.get_rng_state(), state)
    _close(out, peft_model(x), x)


def _spy(monkeypatch) -> list:
    calls = []
    original = PeftLoraLinear.forward

    def spy(self, *args, **kwargs):
        calls.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PeftLoraLinear, "forward", spy)
    return calls


def test_calls_that_are_not_plain_lora_run_peft(monkeypatch):
    calls = _spy(monkeypatch)
    _, fused = _pair()
    x = torch.randn(3, 6)
    fused(x)
    assert not calls  # plain LoRA: fused
    net = fused.base_model.model
    base_only = net.down.base_layer(torch.relu(net.up.base_layer(x)))
    with fused.disable_adapter():  # PEFT calls the same base layers: the same computation
        torch.testing.assert_close(fused(x), base_only, rtol=0, atol=0)
    assert len(calls) == 2  # adapters disabled: PEFT's forward
    calls.clear()
    _, dora = _pair(use_dora=True)
    dora(x)
    assert len(calls) == 2  # DoRA: PEFT's forward


def _bf16_base(*models):
    """A bf16 model with fp32 adapters, as PEFT leaves a bf16 model (``autocast_adapter_dtype``)."""
    for model in models:
        for layer in (model.base_model.model.up, model.base_model.model.down):
            layer.base_layer.to(torch.bfloat16)


# bf16 roundings along TwoLinear on a bf16 base: the output's two per layer; a gradient's those
# and the backward's two per layer (the base's product, the sum with the branch's).
OUT_ROUNDINGS, GRAD_ROUNDINGS = 4, 8


def _close_in_bf16(actual, expected, roundings, name=""):
    """Both round to bf16 at the same points (the base's output, the sum with the fp32 branch, per
    layer and direction) and differ in the order of their fp32 sums: a rounding may flip by one
    ulp, ``roundings`` of them to first order (tolerances.rounding_tolerances: 3% of the scale for
    the output's 4, 6% for the gradients' 8). The fp32 orders themselves add ~1e-6, negligible.
    A dropped adapter or a wrong scaling moves elements by about the adapter's share, here
    comparable to the base's (B is random)."""
    tol = rounding_tolerances(roundings, expected)
    torch.testing.assert_close(actual, expected, **tol, msg=name or None)


def test_fp32_adapter_on_a_bf16_base_is_fused_and_equals_peft(monkeypatch):
    calls = _spy(monkeypatch)
    peft_model, fused = _pair()
    _bf16_base(peft_model, fused)
    x = torch.randn(2, 5, 6).to(torch.bfloat16)
    out, gx, grads = _run(fused, x)
    assert not calls  # fused, though the adapter is fp32 and the base bf16
    out_ref, gx_ref, grads_ref = _run(peft_model, x)
    assert out.dtype == out_ref.dtype == torch.bfloat16 and gx.dtype == torch.bfloat16
    _close_in_bf16(out, out_ref, OUT_ROUNDINGS)
    _close_in_bf16(gx, gx_ref, GRAD_ROUNDINGS)
    assert grads.keys() == grads_ref.keys() and len(grads) == 4
    for name, grad in grads_ref.items():
        assert grads[name].dtype == torch.float32, name
        _close_in_bf16(grads[name], grad, GRAD_ROUNDINGS, name)


def test_a_bf16_base_with_fp32_adapter_rounds_once_as_peft_does():
    """Bit for bit PEFT's output on a wider layer, where an adapter branch run in bf16 (or a sum
    rounded twice) would differ in about half the elements."""
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["0"], init_lora_weights=False)
    peft_model = get_peft_model(nn.Sequential(nn.Linear(64, 48)), config)
    fused = copy.deepcopy(peft_model)
    fuse_lora_linears(fused)
    for model in (peft_model, fused):
        model.base_model.model[0].base_layer.to(torch.bfloat16)
    x = torch.randn(16, 64).to(torch.bfloat16)
    expected = peft_model(x)
    torch.testing.assert_close(fused(x), expected, rtol=0, atol=0)
    layer = fused.base_model.model[0]
    a, b = (layer.lora_A["default"].weight, layer.lora_B["default"].weight)
    in_bf16 = lora_linear(
        x, layer.base_layer.weight, None, a.bfloat16(), b.bfloat16(), layer.scaling["default"]
    )
    assert (in_bf16 != expected).sum() > expected.numel() // 4  # so the check above can fail


def test_a_bf16_base_keeps_x_not_a_wider_copy():
    """The fp32 cast of a bf16 input is exact, so the node keeps x and casts again in backward:
    a model's LoRA layers hold no fp32 copies of their inputs (2x the memory of x, per layer)."""
    peft_model, fused = _pair()
    _bf16_base(peft_model, fused)
    x = torch.randn(4, 5, 6).to(torch.bfloat16)
    saved = []

    def keep(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = fused.base_model.model.up(x)
    assert [t for t in saved if t.dtype == torch.float32 and t.numel() >= x.numel()] == []
    assert any(t.dtype == torch.bfloat16 and t.numel() == x.numel() for t in saved)
    out.float().sum().backward()
    layer = fused.base_model.model.up
    assert layer.lora_A["default"].weight.grad is not None and layer.lora_B["default"].weight.grad is not None


def test_adapter_narrower_than_the_base_runs_peft(monkeypatch):
    # PEFT adds a bf16 adapter's output to a fp32 base in fp32; the node would round to bf16
    calls = _spy(monkeypatch)
    peft_model, fused = _pair()
    for model in (peft_model, fused):
        model.base_model.model.up.lora_A["default"].bfloat16()
        model.base_model.model.up.lora_B["default"].bfloat16()
    x = torch.randn(3, 6)
    out = fused(x)
    assert calls == [fused.base_model.model.up]
    _close(out, peft_model(x), x)


def test_dropout_on_a_bf16_base_gives_peft_gradients_given_the_same_masks(monkeypatch):
    calls = _spy(monkeypatch)
    peft_model, fused = _pair(lora_dropout=0.5)
    _bf16_base(peft_model, fused)
    x = torch.randn(4, 3, 6).to(torch.bfloat16)
    drawn = record(monkeypatch)
    out, gx, grads = _run(fused, x)
    assert not calls  # fused
    replay(peft_model, drawn)
    out_ref, gx_ref, grads_ref = _run(peft_model, x)
    _close_in_bf16(out, out_ref, OUT_ROUNDINGS)
    _close_in_bf16(gx, gx_ref, GRAD_ROUNDINGS)
    for name, grad in grads_ref.items():
        _close_in_bf16(grads[name], grad, GRAD_ROUNDINGS, name)


def test_adapter_that_takes_x_uncast_runs_peft(monkeypatch):
    calls = _spy(monkeypatch)
    peft_model, fused = _pair()
    for model in (peft_model, fused):
        for layer in (model.base_model.model.up, model.base_model.model.down):
            layer.lora_A["default"].double()
            layer.lora_B["default"].double()
        model.base_model.model.up.cast_input_dtype_enabled = False
    x = torch.randn(3, 6)
    with pytest.raises(RuntimeError):  # PEFT itself: a fp32 x into a fp64 adapter
        peft_model(x)
    calls.clear()
    with pytest.raises(RuntimeError):
        fused(x)
    assert calls == [fused.base_model.model.up]  # that layer ran PEFT's forward, as asked


def test_autocast_runs_peft(monkeypatch):
    # autocast recasts the matmuls to bf16 while the adapter stays fp32: one node cannot mix them
    calls = _spy(monkeypatch)
    peft_model, fused = _pair()
    x = torch.randn(3, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = fused(x), peft_model(x)
    assert len(calls) == 4  # both layers of both models: PEFT's forward
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=0, atol=0)  # both PEFT's forward: the same ops


def test_fused_model_survives_deepcopy_and_pickle():
    _, fused = _pair()
    x = torch.randn(3, 6)
    clone = pickle.loads(pickle.dumps(fused))
    torch.testing.assert_close(clone(x), fused(x), rtol=0, atol=0)  # the same node, the same weights
    assert type(copy.deepcopy(fused).base_model.model.up) is FusedLoraLinear
    assert fuse_lora_linears(fused) == 0  # already fused


def test_on_a_bf16_base_backward_holds_the_fp32_copies_one_at_a_time():
    # the adapter's fp32 copies of x and of the output gradient live only inside the adapter's
    # gradients, and its fp32 share of x's gradient is rounded before the base's is allocated:
    # before, all of them were alive at once (8 x-sized bf16 tensors)
    torch.manual_seed(0)
    tokens, width = 256, 256
    base = nn.Linear(width, width, bias=False).to(torch.bfloat16).requires_grad_(False)
    lora_a = torch.randn(4, width, requires_grad=True)
    lora_b = torch.randn(width, 4, requires_grad=True)
    x = torch.randn(tokens, width, dtype=torch.bfloat16, requires_grad=True)
    out = lora_linear(x, base.weight, None, lora_a, lora_b, 2.0)
    grad = torch.randn_like(out)
    peak, _ = peak_bytes(lambda: out.backward(grad))
    assert peak / (tokens * width * 2) < 6.0  # now 4.1; halfway, room for a BLAS's scratch
    assert x.grad.dtype == torch.bfloat16 and lora_a.grad is not None and lora_b.grad is not None
