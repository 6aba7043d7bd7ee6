"""The ``torch`` backend: plain-torch implementations that run anywhere, CPU included.

Each computes exactly what the Hugging Face module computes (same casts, same rounding points);
only the kernels differ. Whether an op is in ``DEFAULT_KERNEL_CONFIG``'s chains depends on the
measurements in ``README.md`` (``bench/micro/kernel_bench.py``), not on this file.

- ``rms_norm``: an autograd function with a hand-written backward (fewer full-size passes than
  autograd through ``LlamaRMSNorm``'s six elementwise ops, and less saved for backward).
- ``rms_norm_zero_centered``: the same for Qwen3.5's ``x_hat * (1 + w)`` norm.
- ``swiglu_mlp``: ``down(silu(gate(x)) * up(x))`` with ``silu(gate)`` recomputed in backward
  instead of saved (one ``tokens x intermediate`` activation less per layer). The projections
  stay the module's own ``Linear`` children, looked up at call time, so LoRA wrappers attached
  before or after ``kernelize`` are used; fusing gate and up into one matmul would bypass them.
  When all three are plain LoRA layers the whole MLP runs as one node (``kernel/lora/mlp.py``),
  which on the CPU keeps what autograd would (recomputing cost more time than the memory was
  worth there) and elsewhere keeps ``gate`` and ``up`` only. Liger's backend uses that node too.

- ``lora_attention``: a Llama, Mistral or Qwen2 attention layer (Qwen2-VL's and Qwen2.5-VL's
  language models included) whose query, key and value
  projections are plain LoRA layers runs them and the rotary embedding as one node
  (``kernel/lora/qkv.py``), then the attention function and ``o_proj`` as Hugging Face's forward
  does. Anything else (a KV cache, eager attention, a trainable base, ...) runs the class's
  own forward. This restates those families' ~10-line attention forward (they differ only in
  the sliding window they pass); ``tests/kernel/test_lora_attention.py`` checks it against
  the class's forward, so a ``transformers`` release that changes the forward fails a test.

Forwards are module-level functions bound with ``types.MethodType``: ``copy.deepcopy`` copies a
bound method along with its module, where a closure would keep pointing at the original's weights."""

import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from twinkle.kernel.lora.mlp import lora_mlp
from twinkle.kernel.lora.qkv import lora_qkv, rotated_projections
from twinkle.kernel.module_checks import require_silu, rms_norm_eps
from twinkle.kernel.registry import register_op


def _always() -> bool:
    return True


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm with a hand-written backward; ``zero_centered`` selects Qwen3.5's form.

    Llama (``LlamaRMSNorm``): ``w * (x_f * r).to(x.dtype)``; Qwen3.5: ``(x_f * r * (1 + w_f)).to(x.dtype)``
    with ``x_f`` the input in fp32 and ``r = rsqrt(mean(x_f^2) + eps)``. Casts and rounding points
    are the module's own. Only ``x`` and ``r`` are saved; ``x_f * r`` is recomputed in backward.

    Why it is faster than autograd on the module (and why ``F.rms_norm`` is not: on CPU it
    decomposes into the same elementwise ops and their autograd): the sum of squares is one
    reduction (``vector_norm``) instead of ``pow`` then ``mean``, and the input gradient is
    ``r * (g_y - x_hat * mean(g_y * x_hat))`` in three passes instead of autograd's chain through
    ``mul``, ``rsqrt``, ``mean`` and ``pow``. No weight gradient is computed for a frozen weight."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool
    ) -> torch.Tensor:
        x_f = x.float()
        hidden = x.shape[-1]
        sum_sq = torch.linalg.vector_norm(x_f, dim=-1, keepdim=True).square_()
        rstd = sum_sq.div_(hidden).add_(eps).rsqrt_()
        ctx.save_for_backward(x, weight, rstd)
        ctx.zero_centered = zero_centered
        if zero_centered:
            return (x_f * rstd * (1.0 + weight.float())).to(x.dtype)
        normed = (x_f * rstd).to(x.dtype)
        if weight.dtype == x.dtype:  # scaled in place: the same products (a * b == b * a), one tensor fewer
            return normed.mul_(weight)
        return weight * normed

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, rstd = ctx.saved_tensors
        x_hat = x.float() * rstd
        lead = tuple(range(grad.dim() - 1))
        grad_weight = None
        if ctx.zero_centered:
            grad_f = grad.float()
            if ctx.needs_input_grad[1]:
                grad_weight = (grad_f * x_hat).sum(lead).to(weight.dtype)
            grad_hat = grad_f * (1.0 + weight.float())
        else:
            if ctx.needs_input_grad[1]:
                grad_weight = (grad * x_hat.to(x.dtype)).sum(lead).to(weight.dtype)
            # autograd rounds the gradient of ``x_hat.to(x.dtype)`` to x.dtype: do the same
            grad_hat = (grad * weight).to(x.dtype).float()
        grad_x = None
        if ctx.needs_input_grad[0]:
            dot = (grad_hat * x_hat).mean(-1, keepdim=True)
            grad_x = grad_hat.addcmul_(x_hat, dot, value=-1.0).mul_(rstd).to(x.dtype)  # grad_hat is ours
        return grad_x, grad_weight, None, None


def rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``, normalised in fp32 like ``LlamaRMSNorm``."""
    return RMSNormFunction.apply(hidden_states, weight, eps, False)


def rms_norm_zero_centered(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(x_hat * (1 + weight)).to(x.dtype)``, all in fp32, like ``Qwen3_5RMSNorm``."""
    return RMSNormFunction.apply(hidden_states, weight, eps, True)


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
    fused = lora_mlp(self, x)  # three plain LoRA projections: one node (what it keeps: lora/mlp.py)
    if fused is not None:
        return fused
    return self.down_proj(SiLUMul.apply(self.gate_proj(x), self.up_proj(x)))


# what each family's attention forward passes to the attention function beyond Llama's arguments
_ATTENTION_EXTRAS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "LlamaAttention": lambda module: {},
    "MistralAttention": lambda module: {"sliding_window": getattr(module.config, "sliding_window", None)},
    "Qwen2Attention": lambda module: {"sliding_window": module.sliding_window},
    # the language models of Qwen2-VL and Qwen2.5-VL: Qwen2's attention (M-RoPE is in cos/sin)
    "Qwen2VLAttention": lambda module: {"sliding_window": module.sliding_window},
    "Qwen2_5_VLAttention": lambda module: {"sliding_window": module.sliding_window},
}


def _lora_attention_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    cache: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    implementation = self.config._attn_implementation
    fused = None
    if (
        cache is None
        and kwargs.get("past_key_values") is None
        and position_embeddings is not None
        and implementation in ALL_ATTENTION_FUNCTIONS  # "eager" is each family's own function
    ):
        fused = lora_qkv(self, hidden_states, *position_embeddings)
        if fused is None:  # no node (adapters off, a mixed-adapter batch): rotated as it does
            fused = rotated_projections(self, hidden_states, *position_embeddings)
    if fused is None:  # by keyword: the VL classes take the same arguments in another order
        return type(self).forward(
            self,
            hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            cache=cache,
            **kwargs,
        )
    query, key, value = (t.transpose(1, 2) for t in fused)
    output, weights = ALL_ATTENTION_FUNCTIONS[implementation](
        self,
        query,
        key,
        value,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        **_ATTENTION_EXTRAS[type(self).__name__](self),
        **kwargs,
    )
    output = output.reshape(*hidden_states.shape[:-1], -1).contiguous()
    return self.o_proj(output), weights


def _patch_attention(module: torch.nn.Module) -> Callable[..., torch.Tensor]:
    if type(module).__name__ not in _ATTENTION_EXTRAS:
        raise ValueError(
            f"lora_attention knows the forward of {', '.join(_ATTENTION_EXTRAS)}, not {type(module).__name__}"
        )
    return types.MethodType(_lora_attention_forward, module)


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
register_op("lora_attention", "torch", _always, _patch_attention)
