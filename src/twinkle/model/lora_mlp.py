"""A SwiGLU MLP whose three projections are plain LoRA layers, as one autograd node.

``down(silu(gate(x)) * up(x))`` run as PEFT's LoRA layers is some fifteen autograd nodes; here
it is one, with a hand-written backward that uses the ops autograd uses on the unfused layers,
so results are bit-identical. What it keeps depends on the device:

- On the CPU, what autograd keeps, per token four ``intermediate``-wide tensors: ``gate`` (for
  silu's backward), ``silu(gate)`` and ``up`` (for the product's), and the product (the input
  ``down``'s adapter needs for its gradient). Recomputing two of them cost 1.1% of a W1 step
  there (session 12, ``bench/step_ab.py``, 48 steps each way), and W2's memory target is met
  with room to spare.
- On an accelerator, ``gate`` and ``up`` only; backward recomputes ``silu(gate)`` and the
  product (two elementwise kernels a layer, on a step bound by the host's launches). On the
  H200 the four-tensor node kept 716 MiB more than Liger's SwiGLU in W2 (session 15), which
  keeps three; with this one, and the loss's smaller chunks there, W2 peaked 923 MiB lower than
  with Liger's. The recomputed tensors are the same ops on the same inputs, so results do not
  change.

``lora_mlp`` returns None where the MLP is not three plain-LoRA calls (see ``lora_linear``) or
an adapter dropout is active (the masks would have to be drawn in PEFT's order and saved); the
caller then runs the layers one by one."""

from typing import Any

import torch
import torch.nn.functional as F

from twinkle.model.lora_linear import adapter_input, lora_params, plain_loras, project, project_grads


class _LoraMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, recompute, scalings, *params):
        # params: (weight, bias, lora_a, lora_b) of gate, up and down, in that order
        gate_p, up_p, down_p = params[0:4], params[4:8], params[8:12]
        flat = x.reshape(-1, x.shape[-1])
        gate, low_gate = project(flat, adapter_input(flat, gate_p[2]), *gate_p, scalings[0])
        up, low_up = project(flat, adapter_input(flat, up_p[2]), *up_p, scalings[1])
        silu = F.silu(gate)
        act = silu * up
        out, low_down = project(act, adapter_input(act, down_p[2]), *down_p, scalings[2])
        kept = (gate, up) if recompute else (gate, up, silu, act)
        ctx.save_for_backward(flat, low_gate, low_up, low_down, *kept, *params)
        ctx.recompute = recompute
        ctx.scalings = scalings
        ctx.x_shape = x.shape
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        flat, low_gate, low_up, low_down, *rest = ctx.saved_tensors
        if ctx.recompute:
            (gate, up), params = rest[:2], rest[2:]
            silu = F.silu(gate)
            act = silu * up
        else:
            (gate, up, silu, act), params = rest[:4], rest[4:]
        need_x = ctx.needs_input_grad[0]
        needs = ctx.needs_input_grad[3:]
        scalings = ctx.scalings
        g = grad_out.reshape(-1, grad_out.shape[-1])

        def layer_grads(i: int, grad: torch.Tensor, x_in: torch.Tensor, low: torch.Tensor, want_x: bool):
            weight, _, lora_a, lora_b = params[4 * i : 4 * i + 4]
            flags = needs[4 * i : 4 * i + 4]  # weight, bias, lora_a, lora_b
            x_lora = adapter_input(x_in, lora_a) if flags[2] else None
            want = (want_x, False, flags[0], flags[1] and params[4 * i + 1] is not None, flags[2], flags[3])
            grads = project_grads(grad, x_in, x_lora, weight, lora_a, lora_b, low, scalings[i], want)
            return grads[0], grads[2:]

        grad_act, down_grads = layer_grads(2, g, act, low_down, True)
        # the product's and silu's backward, as autograd runs them on the unfused expression
        grad_up = grad_act * silu
        grad_gate = torch.ops.aten.silu_backward(grad_act * up, gate)
        grad_x_gate, gate_grads = layer_grads(0, grad_gate, flat, low_gate, need_x)
        grad_x_up, up_grads = layer_grads(1, grad_up, flat, low_up, need_x)
        grad_x = (grad_x_up + grad_x_gate).view(ctx.x_shape) if need_x else None
        return grad_x, None, None, *gate_grads, *up_grads, *down_grads


def lora_mlp(mlp: Any, x: torch.Tensor, recompute: bool | None = None) -> torch.Tensor | None:
    """``mlp.down_proj(silu(mlp.gate_proj(x)) * mlp.up_proj(x))`` as one node, or None when the
    three projections are not plain LoRA layers without an active dropout. The caller checks
    that the activation is silu. ``recompute``: keep only ``gate`` and ``up`` for backward
    (default: on any device but the CPU)."""
    layers = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    names = plain_loras(layers, x)
    if names is None:
        return None
    params, scalings = lora_params(layers, names)
    if recompute is None:
        recompute = x.device.type != "cpu"
    return _LoraMLP.apply(x, recompute, scalings, *params)
