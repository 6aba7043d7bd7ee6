"""``torch.optim.Muon`` with the Newton-Schulz iterations of same-shaped matrices batched.

torch's Muon orthogonalises each matrix on its own: five iterations of three small bf16 products
each. LoRA's A and B matrices come in a handful of shapes (for SmolLM2-135M, 420 matrices in three
shapes once each is laid wide), so that is 6300 tiny products a step, and a tall matrix (a B)
multiplies through a transposed view, which CPU bf16 kernels run slowly: torch's step takes about a
fifth of a short-row LoRA step. ``BatchedMuon`` stacks the matrices of each shape (tall ones
transposed, as torch orients them) and runs the same iteration as batched products: the same
arithmetic, in bf16 as torch's, with the same momentum, weight decay and learning-rate adjustment,
and the same state (``momentum_buffer``), so checkpoints move between the two. The result equals
torch's up to the bf16 rounding of a batched product (on 420 LoRA matrices over four steps, all but
two bit for bit, the rest within 3e-6). ``build_optimizer`` uses it wherever ``torch.optim.Muon``
is asked for: call op ``muon_step``, ``TWINKLE_BATCHED_MUON=off`` for torch's own."""

import math
from collections import defaultdict

import torch

from twinkle.kernel import registry

OP = "muon_step"
registry.register_call(OP, "batched", lambda: True, "nothing")
registry.register_call(OP, "torch", lambda: True, "nothing", plain=True)


def _adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch's Muon learning-rate adjustment for a matrix of ``shape``."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def newton_schulz(
    stack: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """torch's quintic Newton-Schulz iteration on each (m, k) matrix of ``stack`` (n, m, k),
    m <= k, in bf16."""
    a, b, c = coefficients
    x = stack.bfloat16()
    x = x / torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = torch.bmm(x, x.transpose(1, 2))
        update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, update, x, beta=a)
    return x


def _batched(cls: type) -> type | None:
    """Backend ``batched`` of ``muon_step``: for ``torch.optim.Muon`` itself (a user's subclass
    keeps its own step)."""
    return BatchedMuon if cls is torch.optim.Muon and registry.enabled(OP, "batched") else None


_RUN = {"batched": _batched, "torch": lambda cls: cls}


def muon_class(cls: type) -> type:
    """The optimizer class call op ``muon_step``'s chain chooses for ``cls``: ``BatchedMuon`` for
    ``torch.optim.Muon`` while the batched step is in the chain and usable, else ``cls``. Chosen
    when the optimizer is built."""
    return registry.dispatch(OP, _RUN, cls)


class BatchedMuon(torch.optim.Muon):
    """``torch.optim.Muon``, same arguments and state, one batched iteration per matrix shape."""

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 - torch's Optimizer.step signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, buffers = [], [], []
            self._init_group(group, params, grads, buffers)
            if not params:
                continue
            lr = float(group["lr"])
            momentum, weight_decay = group["momentum"], group["weight_decay"]
            torch._foreach_lerp_(buffers, grads, 1 - momentum)
            updates = torch._foreach_lerp(grads, buffers, momentum) if group["nesterov"] else buffers
            by_shape: dict[tuple, list[int]] = defaultdict(list)
            for i, update in enumerate(updates):
                rows, cols = update.shape
                by_shape[(min(rows, cols), max(rows, cols), update.device, update.dtype)].append(i)
            if weight_decay:
                torch._foreach_mul_(params, 1 - lr * weight_decay)
            for indices in by_shape.values():
                wide = [
                    updates[i].T if updates[i].shape[0] > updates[i].shape[1] else updates[i] for i in indices
                ]
                ortho = newton_schulz(
                    torch.stack(wide), group["ns_coefficients"], group["ns_steps"], group["eps"]
                )
                for j, i in enumerate(indices):
                    out = ortho[j].T if updates[i].shape[0] > updates[i].shape[1] else ortho[j]
                    params[i].add_(out, alpha=-_adjusted_lr(lr, group["adjust_lr_fn"], params[i].shape))
        return loss
