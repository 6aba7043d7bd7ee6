"""A SwiGLU MLP whose three projections are plain LoRA layers, as one autograd node.

``down(silu(gate(x)) * up(x))`` run as PEFT's LoRA layers is some fifteen autograd nodes; here
it is one, with a hand-written backward that uses the ops autograd uses on the unfused layers,
so results are bit-identical. What it keeps depends on the device:

- On the CPU, what autograd keeps, per token four ``intermediate``-wide tensors: ``gate`` (for
  silu's backward), ``silu(gate)`` and ``up`` (for the product's), and the product (the input
  ``down``'s adapter needs for its gradient). Recomputing two of them costs time there, and the
  memory is not what limits CPU training.
- On an accelerator, ``gate`` and ``up`` only; backward recomputes ``silu(gate)`` and the
  product (two elementwise kernels a layer, on a step bound by the host's launches), so the node
  keeps less than Liger's SwiGLU (which keeps three) where memory is what limits.
  The recomputed tensors are the same ops on the same inputs, so results do not change.

On a bf16 model PEFT keeps the adapters fp32, so each wide tensor an adapter reads has an fp32
copy twice its size. Forward and backward free each tensor and copy after its last use, in an
order chosen for the peak: ``bench/micro/mlp_memory.py`` (Qwen2.5-0.5B's MLP, allocations
counted) has the two-tensor node's backward hold 4.5 intermediate-wide bf16 tensors on top of
what it keeps, its forward 5.75.

Active adapter dropout is applied inside the node (``dropout.py``): gate's and up's adapters
each mask x (both in one pass over it), down's masks the product; backward reads the masks' bits where the kernel kept them
and recomputes them from their seeds elsewhere.

``lora_mlp`` walks call op ``lora_mlp``'s chain: ``fused`` (this node) where the MLP is three
plain-LoRA calls (see ``lora_linear``) and ``TWINKLE_LORA_MLP`` is on, else ``modules``: it
returns None and the caller runs the layers one by one."""

from typing import Any

import torch
import torch.nn.functional as F

from twinkle.kernel import registry
from twinkle.kernel.cpu_gemm import times_weight
from twinkle.kernel.lora import dropout
from twinkle.kernel.lora.linear import (
    adapter_input,
    branch_grads,
    draw_drop,
    lora_params,
    param_grads,
    plain_loras,
    project,
)

_SILU_BACKWARD = torch.ops.aten.silu_backward.grad_input
OP = "lora_mlp"
registry.register_call(OP, "fused", lambda: True, "nothing")
registry.register_call(OP, "modules", lambda: True, "nothing", plain=True)


class _LoraMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, recompute, scalings, drops, *params):
        # params: (weight, bias, lora_a, lora_b) of gate, up and down, in that order; drops: their
        # adapters' dropout masks (None for none)
        gate_p, up_p, down_p = params[0:4], params[4:8], params[8:12]
        flat = x.reshape(-1, x.shape[-1])
        paired = _paired(drops, gate_p, up_p)
        if paired:  # gate's and up's masks in one pass over x
            flat_lora = adapter_input(flat, gate_p[2])
            rank = gate_p[2].shape[0]
            low_pair, bits_gate = dropout.masked_low(flat_lora, torch.cat([gate_p[2], up_p[2]]), drops[:2])
            bits_up = None
            gate, low_gate, _ = project(flat, flat_lora, *gate_p, scalings[0], low=low_pair[:, :rank])
            up, low_up, _ = project(flat, flat_lora, *up_p, scalings[1], low=low_pair[:, rank:])
            del flat_lora, low_pair
        else:
            gate, low_gate, bits_gate = project(
                flat, adapter_input(flat, gate_p[2]), *gate_p, scalings[0], drops[0]
            )
            up, low_up, bits_up = project(flat, adapter_input(flat, up_p[2]), *up_p, scalings[1], drops[1])
        silu = F.silu(gate)
        act = silu * up
        kept = (gate, up) if recompute else (gate, up, silu, act)
        del silu  # before down's adapter casts the product to its dtype (on a bf16 model, fp32)
        out, low_down, bits_down = project(act, adapter_input(act, down_p[2]), *down_p, scalings[2], drops[2])
        ctx.save_for_backward(flat, low_gate, low_up, low_down, bits_gate, bits_up, bits_down, *kept, *params)
        ctx.recompute, ctx.paired = recompute, paired
        ctx.scalings, ctx.drops = scalings, drops
        ctx.x_shape = x.shape
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        flat, low_gate, low_up, low_down, *rest = ctx.saved_tensors
        bits, rest = rest[:3], rest[3:]  # the masks' bits (None where not kept)
        if ctx.recompute:
            (gate, up), params = rest[:2], rest[2:]
            silu = F.silu(gate)
            act = silu * up
        else:
            (gate, up, silu, act), params = rest[:4], rest[4:]
        need_x = ctx.needs_input_grad[0]
        needs = ctx.needs_input_grad[4:]
        scalings, drops = ctx.scalings, ctx.drops

        def layer_grads(i: int, grad: torch.Tensor, x_in: torch.Tensor, low: torch.Tensor, need_input: bool):
            """``(grad for the layer's input or None, its parameters' grads)``."""
            weight, bias, lora_a, lora_b = params[4 * i : 4 * i + 4]
            need_w, need_bias, need_a, need_b = needs[4 * i : 4 * i + 4]
            wanted = (need_w, need_bias and bias is not None, need_a, need_b)
            return branch_grads(
                grad,
                x_in,
                x_in,
                weight,
                lora_a,
                lora_b,
                low,
                scalings[i],
                drops[i],
                wanted,
                need_input,
                bits[i],
            )

        # Ordered for the peak on a bf16 model with fp32 adapters, where each intermediate-wide
        # tensor has a twice as large fp32 copy for its adapter: every tensor made here goes once
        # its last use is done (saved ones stay until the node is done either way), and each copy
        # lives only inside one call (``param_grads``, ``input_grad``). The ops and their inputs
        # are those autograd runs on the unfused layers, so the results do not change.
        g = grad_out.reshape(-1, grad_out.shape[-1])
        grad_act, down_grads = layer_grads(2, g, act, low_down, True)
        del act
        grad_silu = grad_act * up
        # in place, each into a buffer at its last use: the same products, two fewer
        # intermediate-wide tensors to allocate (on the CPU a long row's are each a fresh
        # mapping whose pages fault in)
        grad_up = grad_act.mul_(silu)
        del silu, grad_act
        grad_gate = _SILU_BACKWARD(grad_silu, gate, grad_input=grad_silu)
        del grad_silu
        if ctx.paired:
            grad_x, gate_grads, up_grads = _paired_grads(
                (grad_gate, grad_up),
                flat,
                (low_gate, low_up),
                params,
                needs,
                scalings,
                drops,
                bits[0],
                need_x,
            )
        else:
            grad_x_gate, gate_grads = layer_grads(0, grad_gate, flat, low_gate, need_x)
            del grad_gate
            grad_x, up_grads = layer_grads(1, grad_up, flat, low_up, need_x)
            if need_x:
                grad_x = grad_x.add_(grad_x_gate)
        if need_x:
            grad_x = grad_x.view(ctx.x_shape)
        return grad_x, None, None, None, *gate_grads, *up_grads, *down_grads


def _paired(drops: tuple, gate_p: tuple, up_p: tuple) -> bool:
    """Whether gate's and up's masked products run as one: both masked, adapters alike."""
    a_gate, a_up = gate_p[2], up_p[2]
    return (
        drops[0] is not None
        and drops[1] is not None
        and a_gate.shape == a_up.shape
        and a_gate.dtype == a_up.dtype
    )


def _paired_grads(grads, flat, lows, params, needs, scalings, drops, bits, need_x):
    """Gate's and up's gradients when their masks ran as one (``_paired``): ``(grad_x, gate's,
    up's)``, A's gradients and both adapters' shares of x's from one pass over x."""
    g_lows, out = [], []
    grad_x = None
    for i in range(2):
        weight, bias, lora_a, lora_b = params[4 * i : 4 * i + 4]
        need_w, need_bias, _, need_b = needs[4 * i : 4 * i + 4]
        wanted = (need_w, need_bias and bias is not None, False, need_b)
        g_low, layer = param_grads(grads[i], flat, None, lora_a, lora_b, lows[i], scalings[i], wanted)
        g_lows.append(g_low)
        out.append(layer)
        if need_x:
            grad_x = (
                times_weight(grads[i], weight)
                if grad_x is None
                else grad_x.add_(times_weight(grads[i], weight))
            )
    a_gate, a_up = params[2], params[6]
    need_a = (needs[2], needs[6])
    grad_a = dropout.masked_input_grads(
        adapter_input(flat, a_gate), torch.cat([a_gate, a_up]), torch.cat(g_lows, 1), drops[:2], grad_x,
        any(need_a), bits,
    )  # fmt: skip
    rank = a_gate.shape[0]
    parts = (grad_a[:rank], grad_a[rank:]) if grad_a is not None else (None, None)
    layers = tuple(
        (w, b, part if need else None, b_grad)
        for (w, b, _, b_grad), part, need in zip(out, parts, need_a, strict=True)
    )
    return grad_x, layers[0], layers[1]


def _fused(mlp: Any, x: torch.Tensor, recompute: bool | None) -> torch.Tensor | None:
    """Backend ``fused`` of ``lora_mlp``: the MLP as one node, None where it does not apply."""
    if not registry.enabled(OP, "fused"):
        return None
    layers = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    names = plain_loras(layers, x)
    if names is None:
        return None
    params, scalings = lora_params(layers, names)
    if recompute is None:
        recompute = x.device.type != "cpu"
    drops = tuple(draw_drop(layer, name) for layer, name in zip(layers, names, strict=True))
    return _LoraMLP.apply(x, recompute, scalings, drops, *params)


def _modules(mlp: Any, x: torch.Tensor, recompute: bool | None) -> None:
    """Backend ``modules`` of ``lora_mlp``: the caller runs the three layers one by one."""
    return None


_RUN = {"fused": _fused, "modules": _modules}


def lora_mlp(mlp: Any, x: torch.Tensor, recompute: bool | None = None) -> torch.Tensor | None:
    """``mlp.down_proj(silu(mlp.gate_proj(x)) * mlp.up_proj(x))`` as call op ``lora_mlp``'s chain
    chooses: one node (``fused``, where the three projections are plain LoRA layers), or None
    (``modules``: the caller runs the layers one by one). The caller checks that the activation
    is silu. ``recompute``: keep only ``gate`` and ``up`` for backward (default: on any device
    but the CPU)."""
    return registry.dispatch(OP, _RUN, mlp, x, recompute)
