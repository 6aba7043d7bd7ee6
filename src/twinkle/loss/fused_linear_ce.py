"""Chunked linear + cross-entropy: only one chunk of logits is ever alive.

The forward pass walks the rows in chunks, computes each chunk's logits in fp32, its loss, and
right away the gradients for the hidden states and the head weight (softmax minus one-hot), then
drops the logits. Backward only scales the stored gradients by the incoming scalar.

Each chunk's logits are read by one max (no indices), then torch's softmax kernel, in place on
the CPU; the log-sum-exp is ``max - log(largest probability)``, the largest probability being
``1 / sum(exp(x - max))``, so the loss and the gradient share the kernel's one exp. A position
counts as correct when its target's logit is the row's maximum (a tie at the top counts too;
``argmax`` would pick the first). This is faster than a max with its indices, an in-place
``exp(x - max)``, a sum and a division, with the same loss to the last bit: the max's indices
alone cost about as much as the softmax (``bench/micro/ce_bench.py``)."""

import torch
import torch.nn.functional as F

from twinkle.kernel.cpu_gemm import linear, times_weight
from twinkle.loss.base import HeadLoss, LossView
from twinkle.loss.cross_entropy import (
    IGNORE_INDEX,
    LossOutput,
    check_reduction,
    finish,
    logps_output,
    top_is_target,
)

# On the CPU a chunk holds about this many logits (fp32): 32M = 128 MiB, ~680 rows at a 49k
# vocabulary. Larger chunks keep the head's matmuls efficient: a quarter of the rows per chunk
# was measurably slower (bench/micro).
CHUNK_ELEMENTS = 2**25
# On an accelerator the head's products are a small part of a step bound by the host's launches,
# while a chunk's fp32 logits, their softmax and its bf16 copy (~2.5x the chunk) come on top of
# the step's activation peak, the loss running at the end of the forward. 8M logits (32 MiB,
# ~170 rows at a 49k vocabulary) keep that near 80 MiB instead of 320.
ACCELERATOR_CHUNK_ELEMENTS = 2**23


def auto_chunk_rows(vocab_size: int, device_type: str = "cpu") -> int:
    elements = CHUNK_ELEMENTS if device_type == "cpu" else ACCELERATOR_CHUNK_ELEMENTS
    return max(1, elements // max(1, vocab_size))


def zero_from(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """An fp32 zero computed from every input: what a head loss of no rows returns, so backward
    still gives each input a (zero) gradient, like ``CrossEntropyLoss``."""
    zero = (hidden.sum() * 0 + weight.sum() * 0).float()
    return zero if bias is None else zero + bias.sum().float() * 0


def softmax_inplace(logits: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension; on the CPU in place of ``logits`` (its kernel reads each
    element before writing it: bit-identical to ``torch.softmax``, no second chunk alive)."""
    if logits.device.type == "cpu":
        return torch.ops.aten._softmax.out(logits, -1, False, out=logits)
    return torch.softmax(logits, dim=-1)


class _FusedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_rows):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        correct = torch.zeros((), dtype=torch.long, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
        for start in range(0, hidden.shape[0], chunk_rows):
            h = hidden[start : start + chunk_rows]
            t = targets[start : start + chunk_rows]
            logits = linear(h, weight).float()
            if bias is not None:
                logits += bias.float()
            top = logits.amax(dim=-1)
            target_logit = logits.gather(1, t[:, None]).squeeze(1)
            correct += (target_logit == top).sum()
            probs = softmax_inplace(logits)
            # the largest probability is exp(top - top) / sum: log-sum-exp = top + log(sum)
            loss_sum += (top - probs.amax(dim=-1).log() - target_logit).sum()
            if need_h or need_w or need_b:
                grad_logits = probs
                grad_logits[torch.arange(t.numel(), device=t.device), t] -= 1
                if need_h:
                    grad_h[start : start + chunk_rows] = times_weight(
                        grad_logits.to(weight.dtype), weight
                    ).to(hidden.dtype)
                if need_w:
                    grad_w += grad_logits.t() @ h.float()
                if need_b:
                    grad_b += grad_logits.sum(0)
        ctx.save_for_backward(*(g if g is not None else torch.empty(0) for g in (grad_h, grad_w, grad_b)))
        ctx.flags = (need_h, need_w, need_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        ctx.mark_non_differentiable(correct)
        return loss_sum, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        need_h, need_w, need_b = ctx.flags
        dt_h, dt_w, dt_b = ctx.dtypes
        out_h = (grad_h * grad_loss).to(dt_h) if need_h else None
        out_w = (grad_w * grad_loss).to(dt_w) if need_w else None
        out_b = (grad_b * grad_loss).to(dt_b) if need_b else None
        return out_h, out_w, out_b, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy of ``hidden @ weight.T (+ bias)`` against ``targets`` and the number
    of rows whose target has the largest logit, without materialising more than ``chunk_rows`` logit rows
    (default: about 128 MiB of fp32 logits on the CPU, 32 MiB elsewhere)."""
    if hidden.shape[0] == 0:
        return zero_from(hidden, weight, bias), torch.zeros((), dtype=torch.long, device=hidden.device)
    chunk_rows = chunk_rows or auto_chunk_rows(weight.shape[0], hidden.device.type)
    return _FusedLinearCE.apply(hidden, weight, bias, targets, chunk_rows)


class FusedLinearCrossEntropyLoss(HeadLoss):
    """Drop-in for ``CrossEntropyLoss`` with a memory footprint of one chunk of logits.

    Called as ``loss(inputs, outputs)`` (upstream's convention), it runs fused when
    ``outputs["lm_head"]`` holds the head and ``outputs["logits"]`` the final hidden states, and
    as plain cross-entropy on ``outputs["logps"]``/``outputs["logits"]`` otherwise."""

    def __init__(self, reduction: str = "sum", chunk_rows: int | None = None):
        self.reduction = check_reduction(reduction)
        self.chunk_rows = chunk_rows

    def compute(self, view: LossView) -> LossOutput:
        if view.hidden is not None:
            loss_sum, correct = fused_linear_cross_entropy(
                view.hidden, view.weight, view.targets, view.bias, self.chunk_rows
            )
            return finish(loss_sum, view.targets.numel(), correct, self.reduction)
        if view.logits is None:
            return logps_output(view, IGNORE_INDEX, self.reduction, dft=False)
        logits = view.logits.float()
        loss_sum = F.cross_entropy(logits, view.targets, reduction="sum")
        return finish(
            loss_sum, view.targets.numel(), top_is_target(logits.detach(), view.targets), self.reduction
        )
