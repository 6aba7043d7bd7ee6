"""The ``torch`` backend: plain-torch implementations that run anywhere, CPU included.

Each computes exactly what the Hugging Face module computes (same casts, same rounding points);
only the kernels differ. Whether an op is in ``DEFAULT_KERNEL_CONFIG``'s chains depends on the
measurements in ``README.md`` (``bench/kernels.py``), not on this file.

- ``rms_norm``: ``F.rms_norm``, a single fused ATen kernel forward and backward, instead of the
  six elementwise ops of ``LlamaRMSNorm``.
- ``rms_norm_zero_centered``: the same for Qwen3.5's ``x_hat * (1 + w)`` norm.
- ``swiglu_mlp``: ``down(silu(gate(x)) * up(x))`` with ``silu(gate)`` recomputed in backward
  instead of saved (one ``tokens x intermediate`` activation less per layer). The projections
  stay the module's own ``Linear`` children, looked up at call time, so LoRA wrappers attached
  before or after ``kernelize`` are used; fusing gate and up into one matmul would bypass them.

There is no ``rotary`` op: Hugging Face applies rotary embeddings through a module-level function
called from inside each attention forward, so replacing it per instance would mean copying every
family's attention forward (see ``README.md``).

Forwards are module-level functions bound with ``types.MethodType``: a bound method deep-copies
and pickles with its module, where a closure would keep pointing at the original's weights."""

import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from twinkle.kernel.module_checks import require_silu, rms_norm_eps
from twinkle.kernel.registry import register_op


def _always() -> bool:
    return True


def rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``, normalised in fp32 like ``LlamaRMSNorm``."""
    shape = (hidden_states.shape[-1],)
    if hidden_states.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(hidden_states, shape, weight, eps)  # the cast is a no-op: fuse the weight in
    normed = F.rms_norm(hidden_states.float(), shape, eps=eps)
    return weight * normed.to(hidden_states.dtype)


def rms_norm_zero_centered(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(x_hat * (1 + weight)).to(x.dtype)``, all in fp32, like ``Qwen3_5RMSNorm``."""
    shape = (hidden_states.shape[-1],)
    return F.rms_norm(hidden_states.float(), shape, 1.0 + weight.float(), eps).type_as(hidden_states)


class SiLUMul(torch.autograd.Function):
    """``silu(gate) * up``, saving only its inputs. The backward uses the same ATen ops as autograd
    on the eager expression (``mul``, ``silu_backward``), so gradients are bit-identical to it."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        gate, up = ctx.saved_tensors
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        grad_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up


def _rms_norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, rms_norm_eps(self))


def _rms_norm_zero_centered_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm_zero_centered(hidden_states, self.weight, rms_norm_eps(self))


def _swiglu_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(SiLUMul.apply(self.gate_proj(x), self.up_proj(x)))


def _binder(forward: Callable[..., torch.Tensor]) -> Callable[[torch.nn.Module], Callable[..., torch.Tensor]]:
    def patch(module: torch.nn.Module) -> Callable[..., torch.Tensor]:
        return types.MethodType(forward, module)

    return patch


def _patch_swiglu(module: torch.nn.Module) -> Callable[..., torch.Tensor]:
    require_silu(module)
    return types.MethodType(_swiglu_forward, module)


register_op("rms_norm", "torch", _always, _binder(_rms_norm_forward))
register_op("rms_norm_zero_centered", "torch", _always, _binder(_rms_norm_zero_centered_forward))
register_op("swiglu_mlp", "torch", _always, _patch_swiglu)
