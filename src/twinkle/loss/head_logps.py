"""Each supervised row's target log-probability through the output head, in chunks of rows.

``head_logps(hidden, weight, targets, bias)`` is ``-cross_entropy(hidden @ weight.T + bias,
targets, reduction="none")``, what preference and policy losses and a reference pass read. The
head's product goes through ``twinkle.kernel.cpu_gemm``, as in ``twinkle.loss.head``, and the
log-sum-exp shares the softmax kernel's one exp, as in ``fused_linear_ce``. With gradients, each
chunk's softmax is kept for the backward pass (what autograd keeps for ``log_softmax`` too);
without them only one chunk of logits is ever alive."""

import torch

from twinkle.kernel.cpu_gemm import linear, times_weight
from twinkle.loss.cross_entropy import IGNORE_INDEX
from twinkle.loss.fused_linear_ce import auto_chunk_rows, softmax_inplace, zero_from


class _HeadLogps(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_rows):
        keep = any(ctx.needs_input_grad[:3])
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        probs = []
        for start in range(0, hidden.shape[0], chunk_rows):
            t = targets[start : start + chunk_rows].clamp(min=0)
            logits = linear(hidden[start : start + chunk_rows], weight, None).float()
            if bias is not None:
                logits += bias.float()
            top = logits.amax(dim=-1)
            target_logit = logits.gather(1, t[:, None]).squeeze(1)
            p = softmax_inplace(logits)
            # log-sum-exp = top - log(largest probability), the largest being 1 / sum(exp(x - top))
            out[start : start + chunk_rows] = target_logit - top + p.amax(dim=-1).log()
            if keep:
                probs.append(p)
        ignored = targets == IGNORE_INDEX
        out.masked_fill_(ignored, 0.0)
        ctx.chunk_rows = chunk_rows
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(hidden, weight, targets, *probs)
        ctx.mark_non_differentiable(ignored)
        return out, ignored

    @staticmethod
    def backward(ctx, grad_out, _grad_ignored):
        hidden, weight, targets, *probs = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        g = grad_out.float().masked_fill(targets == IGNORE_INDEX, 0.0)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        for i, p in enumerate(probs):
            rows = slice(i * ctx.chunk_rows, i * ctx.chunk_rows + p.shape[0])
            # d logp / d logits = one_hot(target) - softmax, scaled by each row's incoming gradient
            grad_logits = p * -g[rows, None]
            t = targets[rows].clamp(min=0)
            grad_logits[torch.arange(t.numel(), device=t.device), t] += g[rows]
            if need_h:
                grad_h[rows] = times_weight(grad_logits.to(weight.dtype), weight).to(hidden.dtype)
            if need_w:
                grad_w += grad_logits.t() @ hidden[rows].float()
            if need_b:
                grad_b += grad_logits.sum(0)
        out_w = grad_w.to(weight.dtype) if need_w else None
        out_b = grad_b.to(ctx.bias_dtype) if need_b else None
        return grad_h, out_w, out_b, None, None


def head_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """``(N,)`` fp32 log-probability of each row's target under ``hidden @ weight.T (+ bias)``
    (0 where the target is ``IGNORE_INDEX``), differentiable in ``hidden``, ``weight`` and
    ``bias``; at most ``chunk_rows`` rows of logits at a time (default as ``fused_linear_ce``)."""
    if hidden.shape[0] == 0:
        return zero_from(hidden, weight, bias).expand(0)
    chunk_rows = chunk_rows or auto_chunk_rows(weight.shape[0], hidden.device.type)
    return _HeadLogps.apply(hidden, weight, bias, targets, chunk_rows)[0]
