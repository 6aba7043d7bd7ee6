"""Reference tests for the ``torch`` kernel backend (the only one that runs on CPU).

Each op is run the way ``kernelize`` runs it (the Hugging Face module, patched through the
registry) and compared with a plain torch reference written out below: the forward output and
the gradient of every input (the hidden states and each weight)."""

import math

import pytest
import torch
import torch.nn.functional as F
from tolerances import chain_tolerances
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

from twinkle.kernel import KernelChoice, kernelize

# ---- plain torch references: what the Hugging Face modules compute --------------------------


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``LlamaRMSNorm``: normalise in fp32, cast back, then scale."""
    x_f = x.float()
    normed = x_f * torch.rsqrt(x_f.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rms_norm_zero_centered_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``Qwen3_5RMSNorm``: normalise and scale by ``1 + weight`` in fp32, cast once at the end."""
    x_f = x.float()
    normed = x_f * torch.rsqrt(x_f.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def swiglu_reference(
    x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """``LlamaMLP`` without bias: ``down(silu(gate(x)) * up(x))``."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


# ---- tolerances --------------------------------------------------------------------------------

TOLERANCES = [
    # fp32: the same math with a different order of floating-point operations (one reduction
    # for the sum of squares instead of pow+mean; a hand-written RMSNorm backward): None, the
    # bound of the test's chain of sums (tolerances.chain_tolerances, about 1e-4 of each tensor's
    # scale); a kernel that ignores the weight or eps, or drops a term, is off by 1e-2 or more.
    pytest.param(torch.float32, None, None, id="fp32"),
    # bf16: the forward casts at the same points as the module, so outputs usually agree
    # exactly; but an fp32 difference of one ulp in rsqrt can flip a bf16 rounding (2**-8
    # relative), and the weight gradient sums such values over rows in bf16.
    pytest.param(torch.bfloat16, 2e-2, 2e-2, id="bf16"),
]

SHAPES = [(2, 8, 32), (3, 7, 96), (1, 64, 576), (17, 48), (2, 5, 257)]  # 2-D input, odd hidden
EPS = 1e-6


def _mlp(hidden: int, intermediate: int, **config) -> LlamaMLP:
    # one attention head: LlamaConfig checks that the hidden size divides into heads
    return LlamaMLP(
        LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=1, **config)
    )


def _patched(module: torch.nn.Module, op: str) -> torch.nn.Module:
    kernelize(module, {type(module).__name__: KernelChoice(op, ("torch",))})
    assert module._twinkle_kernel == (op, "torch")
    return module


def _grads(fn, x: torch.Tensor, params: list[torch.Tensor], grad: torch.Tensor) -> list[torch.Tensor]:
    """The output and the gradient of ``x`` and of each param, for a fresh graph."""
    x = x.detach().clone().requires_grad_()
    for p in params:
        p.grad = None
    out = fn(x)
    out.backward(grad)
    return [out.detach(), x.grad] + [p.grad for p in params]


def _assert_close(ours: list[torch.Tensor], ref: list[torch.Tensor], atol, rtol, sums: list[int]) -> None:
    """``atol``/``rtol`` None: each tensor within the bound of the chain of fp32 sums ``sums``."""
    names = ["output", "input grad"] + [f"weight grad {i}" for i in range(len(ref) - 2)]
    for name, a, b in zip(names, ours, ref, strict=True):
        assert a is not None and b is not None, name
        assert a.dtype == b.dtype, name
        tol = chain_tolerances(sums, b) if atol is None else {"atol": atol, "rtol": rtol}
        torch.testing.assert_close(a, b, **tol, msg=lambda m, name=name: f"{name}: {m}")


def _norm_sums(shape) -> list[int]:
    """RMSNorm's fp32 sums: the squares and the input gradient's dot (hidden each), the weight
    gradient (rows), and a few roundings per element (mean, rsqrt, scalings)."""
    return [shape[-1], shape[-1], math.prod(shape[:-1]), 6]


def _mlp_sums(shape, intermediate: int) -> list[int]:
    """SwiGLU's fp32 sums: gate/up (hidden), down (intermediate), the intermediate gradient
    (hidden), the input gradient (gate's and up's: 2 intermediate), the weight gradients (rows),
    and a few roundings per element (silu, products, bias)."""
    hidden = shape[-1]
    return [hidden, intermediate, hidden, 2 * intermediate, math.prod(shape[:-1]), 8]


def _inputs(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    grad = torch.randn(shape, generator=gen).to(dtype)
    return x, grad


@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(shape, dtype, atol, rtol):
    hidden = shape[-1]
    module = LlamaRMSNorm(hidden, eps=EPS).to(dtype)
    torch.nn.init.normal_(module.weight, mean=1.0, std=0.3)
    ref_weight = module.weight.detach().clone().requires_grad_()
    _patched(module, "rms_norm")
    x, grad = _inputs(shape, dtype)

    ours = _grads(module, x, [module.weight], grad)
    ref = _grads(lambda t: rms_norm_reference(t, ref_weight, EPS), x, [ref_weight], grad)
    _assert_close(ours, ref, atol, rtol, _norm_sums(shape))


@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_zero_centered(shape, dtype, atol, rtol):
    hidden = shape[-1]
    module = Qwen3_5RMSNorm(hidden, eps=EPS).to(dtype)
    torch.nn.init.normal_(module.weight, mean=0.0, std=0.3)
    ref_weight = module.weight.detach().clone().requires_grad_()
    _patched(module, "rms_norm_zero_centered")
    x, grad = _inputs(shape, dtype)

    ours = _grads(module, x, [module.weight], grad)
    ref = _grads(lambda t: rms_norm_zero_centered_reference(t, ref_weight, EPS), x, [ref_weight], grad)
    _assert_close(ours, ref, atol, rtol, _norm_sums(shape))


@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES)
def test_rms_norm_mixed_weight_dtype(dtype, atol, rtol):
    """An fp32 weight on bf16 activations (a norm kept in fp32): the output is promoted, as in HF."""
    module = LlamaRMSNorm(64, eps=EPS)
    torch.nn.init.normal_(module.weight, mean=1.0, std=0.3)
    ref_weight = module.weight.detach().clone().requires_grad_()
    _patched(module, "rms_norm")
    x, grad = _inputs((3, 4, 64), dtype)
    grad = grad.float()

    ours = _grads(module, x, [module.weight], grad)
    ref = _grads(lambda t: rms_norm_reference(t, ref_weight, EPS), x, [ref_weight], grad)
    assert ours[0].dtype == torch.float32
    _assert_close(ours, ref, atol, rtol, _norm_sums((3, 4, 64)))


def test_rms_norm_frozen_weight_gets_no_gradient():
    """Under LoRA the norm weight is frozen: no gradient is computed or stored for it."""
    module = LlamaRMSNorm(32, eps=EPS).requires_grad_(False)
    _patched(module, "rms_norm")
    x, grad = _inputs((2, 3, 32), torch.float32)
    x.requires_grad_()
    module(x).backward(grad)
    assert module.weight.grad is None
    ref_x = x.detach().clone().requires_grad_()
    rms_norm_reference(ref_x, module.weight, EPS).backward(grad)
    torch.testing.assert_close(x.grad, ref_x.grad, **chain_tolerances(_norm_sums((2, 3, 32)), ref_x.grad))


@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES)
@pytest.mark.parametrize("shape, intermediate", [((2, 8, 32), 64), ((3, 7, 48), 80), ((1, 64, 96), 256)])
def test_swiglu_mlp(shape, intermediate, dtype, atol, rtol):
    hidden = shape[-1]
    torch.manual_seed(0)
    module = _mlp(hidden, intermediate).to(dtype)
    weights = [module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight]
    ref_weights = [w.detach().clone().requires_grad_() for w in weights]
    _patched(module, "swiglu_mlp")
    x, grad = _inputs(shape, dtype)

    ours = _grads(module, x, weights, grad)
    ref = _grads(lambda t: swiglu_reference(t, *ref_weights), x, ref_weights, grad)
    _assert_close(ours, ref, atol, rtol, _mlp_sums(shape, intermediate))


def test_swiglu_mlp_with_bias():
    """``mlp_bias=True``: the projections are the module's own Linear layers, bias included."""
    torch.manual_seed(0)
    original = _mlp(32, 64, mlp_bias=True)
    module = _mlp(32, 64, mlp_bias=True)
    module.load_state_dict(original.state_dict())
    _patched(module, "swiglu_mlp")
    x, grad = _inputs((2, 5, 32), torch.float32)
    ours = _grads(module, x, list(module.parameters()), grad)
    ref = _grads(original, x, list(original.parameters()), grad)
    _assert_close(ours, ref, None, None, _mlp_sums((2, 5, 32), 64))
    assert module.gate_proj.bias.grad is not None


def test_references_are_the_hf_modules():
    """The references above are what the unpatched modules compute (exactly, in fp32)."""
    x, _ = _inputs((2, 6, 40), torch.float32)
    norm = LlamaRMSNorm(40, eps=EPS)
    torch.nn.init.normal_(norm.weight, mean=1.0, std=0.3)
    torch.testing.assert_close(norm(x), rms_norm_reference(x, norm.weight, EPS), atol=0, rtol=0)
    zc = Qwen3_5RMSNorm(40, eps=EPS)
    torch.nn.init.normal_(zc.weight, std=0.3)
    torch.testing.assert_close(zc(x), rms_norm_zero_centered_reference(x, zc.weight, EPS), atol=0, rtol=0)
    mlp = _mlp(40, 72)
    ref = swiglu_reference(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    torch.testing.assert_close(mlp(x), ref, atol=0, rtol=0)
