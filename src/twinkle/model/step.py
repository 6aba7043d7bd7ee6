"""The optimizer step: normalise summed gradients by the global token count, clip, step."""

import math
from collections.abc import Iterable

import torch

from twinkle.distributed.collectives import all_reduce_sum


def normalise_gradients(params: Iterable[torch.nn.Parameter], local_tokens: int) -> int:
    """Divide the accumulated (summed) gradients by the supervised tokens of the whole window on
    all ranks. Returns that global count; 0 means there was nothing to learn from."""
    (total,) = all_reduce_sum([local_tokens])
    total = int(total)
    if total > 0:
        for p in params:
            if p.grad is not None:
                p.grad.div_(total)
    return total


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Clip to ``max_norm`` (the global norm over every shard); return the norm before clipping."""
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(grads, max_norm if max_norm > 0 else math.inf)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)
