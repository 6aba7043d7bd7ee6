"""An attention layer's query, key and value projections and their rotary embedding, as one node.

Hugging Face's Llama-style attention runs ``q_proj``, ``k_proj`` and ``v_proj`` on the same input,
then rotates the queries and keys (``q * cos + rotate_half(q) * sin``). With LoRA on the three
projections that is three adapter branches of rank r, each with its own small products, and a
dozen elementwise autograd nodes for the rotation. ``lora_qkv`` computes the same in one node:

- the three adapters' A matrices are stacked, so ``x A^T`` is one product of 3r rows, and so are
  backward's A gradient and the adapters' share of the input gradient (CPU BLAS takes far less
  time for one product of 3r rows than for three of r);
- the rotation and its backward (the rotation by ``-sin``) are three elementwise passes each, on
  the projection's output in place;
- the frozen weights' products are the LoRA node's (``project``'s oneDNN calls).

With an active adapter dropout each adapter takes x through its own mask (``dropout.py``: kept
as bits by the CPU kernel, else recomputed in backward from its seed), so the stacked product
splits into one per adapter.

Outputs and gradients equal the layer-by-layer path up to summation order. ``lora_qkv`` returns
None where the node does not apply (see ``usable``); the caller then runs the layers one by one."""

from typing import Any

import torch

from twinkle.kernel import registry
from twinkle.kernel.cpu_gemm import linear, times_weight
from twinkle.kernel.lora import dropout
from twinkle.kernel.lora.linear import draw_drop, lora_params, plain_loras

OP = "lora_qkv"
registry.register_call(OP, "fused", lambda: True, "nothing")
registry.register_call(OP, "modules", lambda: True, "nothing", plain=True)


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``t * cos + rotate_half(t) * sin`` for ``t`` of shape (tokens, heads, head_dim) and
    ``cos``/``sin`` of (tokens, 1, head_dim), with ``rotate_half(t) = cat(-t2, t1)``."""
    half = t.shape[-1] // 2
    out = t * cos
    out[..., :half].addcmul_(t[..., half:], sin[..., :half], value=-1.0)
    out[..., half:].addcmul_(t[..., :half], sin[..., half:])
    return out


def unrotate(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The gradient of ``rotate(t)`` for the output gradient ``g``: ``y1 = t1 c1 - t2 s1`` and
    ``y2 = t2 c2 + t1 s2`` give ``dt1 = g1 c1 + g2 s2`` and ``dt2 = g2 c2 - g1 s1``."""
    half = g.shape[-1] // 2
    out = g * cos
    out[..., :half].addcmul_(g[..., half:], sin[..., half:])
    out[..., half:].addcmul_(g[..., :half], sin[..., :half], value=-1.0)
    return out


class _LoraQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, head_dim, scalings, drops, *params):
        # params: (weight, bias, lora_a, lora_b) of q, k and v, in that order; drops: their
        # adapters' dropout masks (None for none)
        flat = x.reshape(-1, x.shape[-1])
        tokens = flat.shape[0]
        cos_f = cos.reshape(tokens, 1, head_dim)
        sin_f = sin.reshape(tokens, 1, head_dim)
        a_all = torch.cat([params[2], params[6], params[10]])
        # (3r, tokens): the three adapters' x A^T, r rows each; their masks' bits (or None)
        low, bits = _low(flat, a_all, drops, params)
        outs = []
        start = 0
        for i in range(3):
            weight, bias, lora_a, lora_b = params[4 * i : 4 * i + 4]
            rank = lora_a.shape[0]
            out = linear(flat, weight, bias).addmm_(
                low[start : start + rank].t(), lora_b.t(), alpha=scalings[i]
            )
            start += rank
            out = out.view(tokens, -1, head_dim)
            outs.append(rotate(out, cos_f, sin_f) if i < 2 else out)
        ctx.save_for_backward(flat, low, a_all, cos_f, sin_f, *bits, *params)
        ctx.scalings, ctx.drops = scalings, drops
        ctx.x_shape = x.shape
        lead = x.shape[:-1]
        return tuple(o.view(*lead, *o.shape[1:]) for o in outs)

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_v):
        flat, low, a_all, cos_f, sin_f, *rest = ctx.saved_tensors
        bits, params = rest[:3], rest[3:]
        tokens = flat.shape[0]
        grads_out = []
        for i, g in enumerate((grad_q, grad_k, grad_v)):
            g = g.reshape(tokens, -1, cos_f.shape[-1])
            g = unrotate(g, cos_f, sin_f) if i < 2 else g
            grads_out.append(g.reshape(tokens, -1))
        # the three adapters' gradient for x A^T, stacked as ``low`` is: (3r, tokens)
        g_low = torch.empty_like(low)
        start = 0
        for i, g in enumerate(grads_out):
            lora_a, lora_b = params[4 * i + 2], params[4 * i + 3]
            rank = lora_a.shape[0]
            torch.mm(lora_b.t(), g.t(), out=g_low[start : start + rank]).mul_(ctx.scalings[i])
            start += rank
        drops = ctx.drops
        masked = any(d is not None for d in drops)
        need_a = [ctx.needs_input_grad[6 + 4 * i + 2] for i in range(3)]
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = times_weight(grads_out[0], params[0])
            grad_x.add_(times_weight(grads_out[1], params[4])).add_(times_weight(grads_out[2], params[8]))
            if not masked:
                grad_x.addmm_(g_low.t(), a_all)
        if masked and _stacked(drops, params):  # the three masks in one pass over x
            grad_a_all = dropout.masked_input_grads(
                flat, a_all, g_low.t(), drops, grad_x, any(need_a), bits[0]
            )
            grad_as = [grad_a_all[rows] if grad_a_all is not None else None for rows in _row_slices(params)]
        elif masked:  # each adapter through its own mask: A's gradient and its share of x's at once
            grad_as = []
            for i, (rows, drop, kept) in enumerate(zip(_row_slices(params), drops, bits, strict=True)):
                lora_a = params[4 * i + 2]
                if drop is None:
                    if grad_x is not None:
                        grad_x.addmm_(g_low[rows].t(), lora_a)
                    grad_as.append(g_low[rows] @ flat if need_a[i] else None)
                else:
                    grad_as.append(
                        dropout.masked_input_grads(
                            flat, lora_a, g_low[rows].t(), (drop,), grad_x, need_a[i], kept
                        )
                    )
        else:
            grad_a_all = torch.mm(g_low, flat)
            grad_as = [grad_a_all[rows] for rows in _row_slices(params)]
        if grad_x is not None:
            grad_x = grad_x.view(ctx.x_shape)
        grads: list[torch.Tensor | None] = []
        start = 0
        for i, g in enumerate(grads_out):
            lora_a = params[4 * i + 2]
            rank = lora_a.shape[0]
            grad_a = grad_as[i] if need_a[i] else None
            grad_b = None
            if ctx.needs_input_grad[6 + 4 * i + 3]:
                grad_b = torch.mm(low[start : start + rank], g).t().mul_(ctx.scalings[i])
            start += rank
            grads += [None, None, grad_a, grad_b]
        return grad_x, None, None, None, None, None, *grads


def _row_slices(params: tuple) -> list[slice]:
    """The rows of the stacked A matrices (q's, k's, v's) that belong to each adapter."""
    slices, start = [], 0
    for i in range(3):
        rank = params[4 * i + 2].shape[0]
        slices.append(slice(start, start + rank))
        start += rank
    return slices


def _low(
    flat: torch.Tensor, a_all: torch.Tensor, drops: tuple, params: tuple
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """The three adapters' ``x A^T`` stacked (3r, tokens): one product without masks, one masked
    pass over x for all three where each has its mask and the same rank, else one product per
    adapter; and the masks' bits where the kernel kept them (one tensor for all three, or one
    per adapter)."""
    if all(d is None for d in drops):
        return torch.mm(a_all, flat.t()), [None] * 3
    low = torch.empty(a_all.shape[0], flat.shape[0], dtype=flat.dtype, device=flat.device)
    if _stacked(drops, params):
        return low, [dropout.masked_low(flat, a_all, drops, out=low.t())[1], None, None]
    bits: list[torch.Tensor | None] = []
    for rows, drop in zip(_row_slices(params), drops, strict=True):
        if drop is None:
            torch.mm(a_all[rows], flat.t(), out=low[rows])
            bits.append(None)
        else:
            bits.append(dropout.masked_low(flat, a_all[rows], (drop,), out=low[rows].t())[1])
    return low, bits


def _stacked(drops: tuple, params: tuple) -> bool:
    """Whether the three masked products run as one: every adapter masked, all of one rank."""
    return all(d is not None for d in drops) and len({params[4 * i + 2].shape[0] for i in range(3)}) == 1


def usable(layers: tuple[Any, ...], x: torch.Tensor) -> list[str] | None:
    """The active adapters' names when all three layers are plain LoRA (``plain_loras``; dropout
    allowed), with frozen base weights and adapters in x's dtype; else None."""
    names = plain_loras(layers, x)
    if names is None:
        return None
    for layer, name in zip(layers, names, strict=True):
        base = layer.base_layer
        if layer.lora_A[name].weight.dtype != x.dtype:
            return None
        if base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad):
            return None
    return names


def _tables(
    head_dim: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rotary tables as (batch, tokens, head_dim) for ``x`` of (batch, tokens, hidden), or
    None where they do not fit the rotation here (another layout or dtype, an odd head_dim, or
    tables that want a gradient, which neither path gives them)."""
    if x.dim() != 3 or cos.dim() != 3 or cos.shape[1:] != (x.shape[1], head_dim) or sin.shape != cos.shape:
        return None
    if cos.shape[0] != x.shape[0]:  # one table for the whole batch
        if cos.shape[0] != 1:
            return None
        cos, sin = cos.expand(x.shape[0], -1, -1), sin.expand(x.shape[0], -1, -1)
    if cos.dtype != x.dtype or sin.dtype != x.dtype or head_dim % 2:
        return None
    if cos.requires_grad or sin.requires_grad:
        return None
    return cos, sin


def rotated_projections(
    attention: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(rotated q, rotated k, v)`` as ``lora_qkv`` returns them, from the layers' own forward
    and ``rotate``, without autograd: for a pass the node does not take (adapters off, a
    mixed-adapter batch), so that it rotates as the node does, in three passes instead of
    Hugging Face's six. None under grad mode or where the tables do not fit."""
    if torch.is_grad_enabled():
        return None
    head_dim = attention.head_dim
    tables = _tables(head_dim, x, cos, sin)
    if tables is None:
        return None
    tokens = x.shape[0] * x.shape[1]
    cos_f, sin_f = (t.reshape(tokens, 1, head_dim) for t in tables)
    outs = []
    for i, layer in enumerate((attention.q_proj, attention.k_proj, attention.v_proj)):
        out = layer(x).reshape(tokens, -1, head_dim)
        outs.append(rotate(out, cos_f, sin_f) if i < 2 else out)
    return tuple(o.view(*x.shape[:-1], *o.shape[1:]) for o in outs)


def _fused(
    attention: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Backend ``fused`` of ``lora_qkv``: the projections and rotation as one node, None where
    it does not apply."""
    if not registry.enabled(OP, "fused"):
        return None
    layers = (attention.q_proj, attention.k_proj, attention.v_proj)
    tables = _tables(attention.head_dim, x, cos, sin)
    if tables is None:
        return None
    cos, sin = tables
    names = usable(layers, x)
    if names is None:
        return None
    params, scalings = lora_params(layers, names)
    drops = tuple(draw_drop(layer, name) for layer, name in zip(layers, names, strict=True))
    return _LoraQKV.apply(x, cos, sin, attention.head_dim, scalings, drops, *params)


def _modules(attention: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Backend ``modules`` of ``lora_qkv``: the caller runs the layers and the rotation itself."""
    return None


_RUN = {"fused": _fused, "modules": _modules}


def lora_qkv(
    attention: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(rotated q, rotated k, v)`` of a Llama-style attention module for ``x`` of shape
    (batch, tokens, hidden), each (batch, tokens, heads, head_dim), as call op ``lora_qkv``'s
    chain chooses: one node (``fused``, where ``usable`` says it applies and the rotary tables
    are (batch or 1, tokens, head_dim)), or None (``modules``: the caller runs the layers)."""
    return registry.dispatch(OP, _RUN, attention, x, cos, sin)
