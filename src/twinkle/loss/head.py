"""The output head's product on the supervised rows, ``hidden @ weight.T (+ bias)``, through
``twinkle.kernel.cpu_gemm`` with gradients or without, so a training pass and an evaluation
compute the same logits. At a 49k vocabulary the head is a tall, thin product whose fp32 output
outgrows the caches; there MKL's ``mm``, which ``F.linear`` runs, took up to twice oneDNN's
time (``bench/micro/head_bench.py``)."""

import torch

from twinkle.kernel.cpu_gemm import linear, times_weight


class _HeadLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias):
        ctx.save_for_backward(hidden, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return linear(hidden, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad
        grad_h = times_weight(grad, weight) if need_h else None
        grad_w = grad.t() @ hidden if need_w else None
        grad_b = grad.sum(0).to(ctx.bias_dtype) if need_b else None
        return grad_h, grad_w, grad_b


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``hidden @ weight.T (+ bias)`` for 2-D ``hidden``, through ``cpu_gemm`` with gradients or
    without, so a training pass and an evaluation compute the same logits."""
    return _HeadLogits.apply(hidden, weight, bias)
