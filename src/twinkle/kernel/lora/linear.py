"""A LoRA linear layer as one autograd node.

PEFT computes ``base(x) + lora_B(lora_A(dropout(x))) * scaling`` as five modules and
elementwise ops, each a node in the graph with its own output tensor. ``lora_linear`` does the
same math in one autograd function: the scaled rank-r product is accumulated straight into the
base output (``addmm``), and backward accumulates both input gradients into one tensor. Outputs
and gradients equal PEFT's up to summation order. An active adapter dropout is applied inside
the node (``dropout.py``: PEFT's semantics, a mask drawn from a seed and kept as bits, not as
PEFT's fp32 mask and masked copy), so with a mask the gradients are PEFT's given the same mask.

``fuse_lora_linears`` routes every PEFT ``lora.Linear`` of a model through it whenever the call
is plain LoRA: one active adapter, not merged, dropout (if any) ``nn.Dropout`` with p < 1, no DoRA or other
variant, no LoRA bias, an unhooked ``nn.Linear`` base in x's dtype and no autocast. The adapter
may have its own dtype (PEFT keeps it fp32 on a bf16 model): its branch then runs in that dtype
and the sum is rounded once, as PEFT does. Any other call runs PEFT's own forward."""

from typing import Any

import torch
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from torch import nn

from twinkle.kernel import registry
from twinkle.kernel.cpu_gemm import linear, times_weight
from twinkle.kernel.lora import dropout
from twinkle.kernel.lora.dropout import Drop

OP = "lora_linear"
registry.register_call(OP, "fused", lambda: True, "nothing")
registry.register_call(OP, "peft", lambda: True, "nothing", plain=True)


def _thin(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``(left @ right).T`` for a ``left`` of r rows: the rank-r products computed r rows tall.
    CPU BLAS runs a product r columns wide (``right.T @ left.T``, the same sums) at less than half
    the speed."""
    return torch.mm(left, right).t()


def adapter_input(flat: torch.Tensor, lora_a: torch.Tensor) -> torch.Tensor:
    """x as the adapter takes it: cast to the adapter's dtype (an exact cast to a wider one)."""
    return flat if flat.dtype == lora_a.dtype else flat.to(lora_a.dtype)


def project(
    flat: torch.Tensor,
    flat_lora: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    drop: Drop | None = None,
    low: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(flat W^T + bias + scaling (dropout(flat_lora) A^T) B^T, dropout(flat_lora) A^T, bits)``
    for 2-D ``flat``; ``flat_lora`` is x in the adapter's dtype, ``drop`` its dropout mask (None:
    none), ``bits`` the mask kept for backward where the kernel drew it (``dropout.masked_low``),
    else None. ``low``: the branch's product, when the caller computed it (then ``bits`` is None).
    An adapter wider than the base (PEFT's fp32 adapters on a bf16 model) runs in its own dtype
    and the sum is rounded once to the base's dtype, as PEFT does."""
    bits = None
    if low is not None:
        pass
    elif drop is None:
        low = _thin(lora_a, flat_lora.t())  # (tokens, r)
    else:
        low, bits = dropout.masked_low(flat_lora, lora_a, (drop,))
    out = linear(flat, weight, bias)
    if lora_a.dtype != flat.dtype:
        return out.to(lora_a.dtype).addmm_(low, lora_b.t(), alpha=scaling).to(flat.dtype), low, bits
    return out.addmm_(low, lora_b.t(), alpha=scaling), low, bits


def param_grads(
    g: torch.Tensor,
    flat: torch.Tensor | None,
    flat_lora: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    low: torch.Tensor,
    scaling: float,
    needs: tuple[bool, bool, bool, bool],
) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
    """``(g_low, (grad_weight, grad_bias, grad_a, grad_b))`` for the output gradient ``g`` (2-D),
    each gradient None unless ``needs`` (weight, bias, lora_a, lora_b) asks for it. ``g_low`` is
    the gradient for ``flat_lora A^T`` (tokens, r), which ``input_grad`` takes. ``g`` and
    ``flat_lora`` may be in the base's dtype: they are cast to the adapter's here, so on a bf16
    model their fp32 copies (each as large as the tensor) live only while this runs."""
    need_w, need_bias, need_a, need_b = needs
    g_lora = g.to(lora_b.dtype)
    g_low = _thin(lora_b.t(), g_lora.t()).mul_(scaling)  # (tokens, r)
    grad_a = g_low.t() @ adapter_input(flat_lora, lora_a) if need_a else None
    grad_b = _thin(low.t(), g_lora).mul_(scaling) if need_b else None
    del g_lora
    grad_w = g.t() @ flat if need_w else None
    grad_bias = g.sum(0) if need_bias else None
    return g_low, (grad_w, grad_bias, grad_a, grad_b)


def input_grad(
    g: torch.Tensor, weight: torch.Tensor, g_low: torch.Tensor, lora_a: torch.Tensor
) -> torch.Tensor:
    """Both branches' gradient for x, summed in x's dtype as autograd sums PEFT's. A wider adapter's
    branch is rounded to x's dtype before the base's gradient is allocated, so its wide copy is
    gone by then."""
    if lora_a.dtype != g.dtype:
        from_adapter = (g_low @ lora_a).to(g.dtype)
        return times_weight(g, weight).add_(from_adapter)
    return times_weight(g, weight).addmm_(g_low, lora_a)


def branch_grads(
    g: torch.Tensor,
    flat: torch.Tensor | None,
    flat_lora: torch.Tensor | None,
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    low: torch.Tensor,
    scaling: float,
    drop: Drop | None,
    needs: tuple[bool, bool, bool, bool],
    need_x: bool,
    bits: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, tuple[torch.Tensor | None, ...]]:
    """``project``'s gradients for the output gradient ``g`` (2-D): ``(grad_x, (grad_weight,
    grad_bias, grad_a, grad_b))``, each None unless ``need_x`` / ``needs`` asks for it. ``flat``
    is x for the base weight's gradient, ``flat_lora`` x as the adapter took it before its mask
    (either dtype). With a mask (its bits from ``project``, or None), A's gradient and the
    adapter's share of x's gradient come from one pass over x (``dropout.masked_input_grads``)."""
    if drop is None:
        g_low, grads = param_grads(g, flat, flat_lora, lora_a, lora_b, low, scaling, needs)
        return (input_grad(g, weight, g_low, lora_a) if need_x else None), grads
    need_w, need_bias, need_a, need_b = needs
    g_low, (grad_w, grad_bias, _, grad_b) = param_grads(
        g, flat, None, lora_a, lora_b, low, scaling, (need_w, need_bias, False, need_b)
    )
    grad_x = times_weight(g, weight) if need_x else None
    grad_a = None
    if need_a or need_x:
        source = adapter_input(flat_lora, lora_a)
        grad_a = dropout.masked_input_grads(source, lora_a, g_low, (drop,), grad_x, need_a, bits)
    return grad_x, (grad_w, grad_bias, grad_a, grad_b)


class _LoraLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling, drop):
        flat = x.reshape(-1, x.shape[-1])
        flat_lora = adapter_input(flat, lora_a)
        out, low, bits = project(flat, flat_lora, weight, bias, lora_a, lora_b, scaling, drop)
        # x in the adapter's dtype is an exact cast of x: backward casts again rather than keep the
        # wider copy (on a bf16 model, an fp32 copy of every LoRA layer's input); a mask is kept as
        # bits, or recomputed from its seed
        rebuild = flat_lora is not flat
        keep = flat if ctx.needs_input_grad[1] else None  # x for the base weight's gradient only
        ctx.save_for_backward(keep, flat if rebuild else flat_lora, weight, lora_a, lora_b, low, bits)
        ctx.scaling, ctx.drop, ctx.rebuild = scaling, drop, rebuild
        ctx.has_bias = bias is not None
        ctx.x_shape = x.shape
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        flat, source, weight, lora_a, lora_b, low, bits = ctx.saved_tensors
        need_x, need_w, need_bias, need_a, need_b, _, _ = ctx.needs_input_grad
        g = grad_out.reshape(-1, grad_out.shape[-1])
        needs = (need_w, need_bias and ctx.has_bias, need_a, need_b)
        grad_x, (grad_w, grad_bias, grad_a, grad_b) = branch_grads(
            g, flat, source, weight, lora_a, lora_b, low, ctx.scaling, ctx.drop, needs, need_x, bits
        )
        grad_x = grad_x.view(ctx.x_shape) if grad_x is not None else None
        return grad_x, grad_w, grad_bias, grad_a, grad_b, None, None


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    drop: Drop | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias + scaling * (dropout(x) @ lora_a.T) @ lora_b.T`` in one autograd node;
    ``drop`` (``dropout.draw(p)``) is the adapter's dropout mask, None for none."""
    return _LoraLinear.apply(x, weight, bias, lora_a, lora_b, float(scaling), drop)


def plain_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` itself (no adapter, subclass or wrapper) with no hooks: its output is
    ``x @ weight.T (+ bias)``."""
    return type(module) is nn.Linear and not (module._forward_hooks or module._forward_pre_hooks)


def fusable(layer: Any, x: torch.Tensor, args: tuple, kwargs: dict) -> str | None:
    """The active adapter's name when this call is plain LoRA, else None."""
    if args or kwargs or layer.disable_adapters or layer.merged or len(layer.active_adapters) != 1:
        return None
    name = layer.active_adapters[0]
    if name not in layer.lora_A or name in getattr(layer, "lora_variant", {}):
        return None
    if layer.use_dora.get(name, False) or getattr(layer, "fan_in_fan_out", False):
        return None
    drop_module = layer.lora_dropout[name]
    if not isinstance(drop_module, (nn.Identity, nn.Dropout)):
        return None
    if isinstance(drop_module, nn.Dropout) and drop_module.p >= 1:
        return None  # PEFT returns a zero branch; no mask to scale
    base, a, b = layer.base_layer, layer.lora_A[name], layer.lora_B[name]
    if (
        not (plain_linear(base) and plain_linear(a) and plain_linear(b))
        or a.bias is not None
        or b.bias is not None
    ):
        return None
    if not (x.dtype == base.weight.dtype and a.weight.dtype == b.weight.dtype):
        return None
    if torch.promote_types(x.dtype, a.weight.dtype) != a.weight.dtype:
        return None  # an adapter narrower than the base: PEFT adds in the base's dtype
    if a.weight.dtype != x.dtype and not getattr(layer, "cast_input_dtype_enabled", True):
        return None  # PEFT would hand the adapter x uncast
    if torch.is_autocast_enabled(x.device.type):  # autocast would recast inside the node
        return None
    return name


def draw_drop(layer: Any, name: str) -> Drop | None:
    """A mask for adapter ``name``'s dropout in this call, or None where it draws none
    (``nn.Identity``, p = 0, eval mode)."""
    module = layer.lora_dropout[name]
    if isinstance(module, nn.Dropout) and module.training and module.p > 0:
        return dropout.draw(module.p)
    return None


def _fused(layer: Any, x: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """Backend ``fused`` of ``lora_linear``: the call as one node, None where it is not plain LoRA."""
    if not registry.enabled(OP, "fused"):
        return None
    name = fusable(layer, x, args, kwargs)
    if name is None:
        return None
    base = layer.base_layer
    a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
    return lora_linear(x, base.weight, base.bias, a, b, layer.scaling[name], draw_drop(layer, name))


def _peft(layer: Any, x: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
    """Backend ``peft`` of ``lora_linear``: PEFT's own forward, for every call."""
    return PeftLoraLinear.forward(layer, x, *args, **kwargs)


_RUN = {"fused": _fused, "peft": _peft}


class FusedLoraLinear(PeftLoraLinear):
    """PEFT's LoRA linear layer whose calls walk call op ``lora_linear``'s chain: plain-LoRA calls
    as one autograd node (``fused``), every other call PEFT's forward (``peft``)."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return registry.dispatch(OP, _RUN, self, x, args, kwargs)


def plain_loras(layers: tuple[Any, ...], x: torch.Tensor) -> list[str] | None:
    """The active adapters' names when every layer is a ``FusedLoraLinear`` whose call on ``x``
    is plain LoRA (``fusable``); else None. For nodes that run several LoRA layers at once
    (``lora_mlp``, ``lora_qkv``), which draw each layer's dropout mask with ``draw_drop`` in the
    layers' order."""
    if not registry.enabled(OP, "fused") or any(type(layer) is not FusedLoraLinear for layer in layers):
        return None
    names = [fusable(layer, x, (), {}) for layer in layers]
    return None if None in names else names


def lora_params(
    layers: tuple[Any, ...], names: list[str]
) -> tuple[list[torch.Tensor | None], tuple[float, ...]]:
    """``(weight, bias, lora_a, lora_b)`` of each layer in order, flattened, and their scalings."""
    params: list[torch.Tensor | None] = []
    for layer, name in zip(layers, names, strict=True):
        base = layer.base_layer
        params += [base.weight, base.bias, layer.lora_A[name].weight, layer.lora_B[name].weight]
    return params, tuple(float(layer.scaling[n]) for layer, n in zip(layers, names, strict=True))


def fuse_lora_linears(model: nn.Module) -> int:
    """Give each PEFT ``lora.Linear`` in ``model`` the one-node forward; returns how many.

    The layers' class becomes a subclass of PEFT's, so ``isinstance`` checks, ``deepcopy`` and
    pickling keep working. Idempotent."""
    count = 0
    for module in model.modules():
        if type(module) is PeftLoraLinear:
            module.__class__ = FusedLoraLinear
            count += 1
    return count
