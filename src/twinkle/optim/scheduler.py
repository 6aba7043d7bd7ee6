"""Warm-up schedules that end where the data ends and never step at learning rate 0.

A schedule is a ``LambdaLR`` whose factor for optimizer step ``k`` (0-based, of ``total``) is:
warm-up ``(k + 1) / warmup`` for ``k < warmup``, then a decay from 1 over the remaining steps
that stays above 0 at the last step ``total - 1``."""

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from twinkle.utils.errors import UserError


def _warmup_then(decay: Callable[[float], float], warmup: int, total: int, min_ratio: float):
    def factor(k: int) -> float:
        if k < warmup:
            return (k + 1) / warmup
        span = max(1, total - warmup)
        # In [0, 1) for every step of the horizon; a run that goes past it (e.g. resumed with
        # --ignore-data-skip) stays at the last step's rate instead of stepping at 0.
        progress = min((k - warmup) / span, (span - 1) / span)
        return min_ratio + (1 - min_ratio) * decay(progress)

    return factor


def CosineWarmupScheduler(  # noqa: N802 - a class-like name is the public API
    optimizer: torch.optim.Optimizer,
    num_warmup_steps: int,
    num_training_steps: int,
    min_lr_ratio: float = 0.0,
) -> LambdaLR:
    """Linear warm-up, then half a cosine."""
    decay = lambda p: 0.5 * (1 + math.cos(math.pi * p))  # noqa: E731
    return LambdaLR(optimizer, _warmup_then(decay, num_warmup_steps, num_training_steps, min_lr_ratio))


def LinearWarmupScheduler(  # noqa: N802
    optimizer: torch.optim.Optimizer,
    num_warmup_steps: int,
    num_training_steps: int,
    min_lr_ratio: float = 0.0,
) -> LambdaLR:
    """Linear warm-up, then a straight line down."""
    return LambdaLR(
        optimizer, _warmup_then(lambda p: 1 - p, num_warmup_steps, num_training_steps, min_lr_ratio)
    )


SCHEDULERS: dict[str, Callable[..., LRScheduler]] = {
    "CosineWarmupScheduler": CosineWarmupScheduler,
    "LinearWarmupScheduler": LinearWarmupScheduler,
}


def _torch_scheduler_names() -> list[str]:
    module = torch.optim.lr_scheduler
    return sorted(
        n
        for n, o in vars(module).items()
        if inspect.isclass(o) and issubclass(o, LRScheduler) and o is not LRScheduler
    )


def build_scheduler(
    scheduler_cls: str | Callable[..., LRScheduler],
    optimizer: torch.optim.Optimizer,
    num_warmup_steps: int,
    num_training_steps: int,
    **kwargs: Any,
) -> LRScheduler:
    """Our warm-up schedules take the step counts; a ``torch.optim.lr_scheduler`` name or class
    gets only ``kwargs`` (its own arguments, e.g. ``T_max``)."""
    if num_warmup_steps < 0 or num_training_steps < 1:
        raise UserError(
            f"need num_warmup_steps >= 0 and num_training_steps >= 1, got {num_warmup_steps} and {num_training_steps}"
        )
    if isinstance(scheduler_cls, str):
        if scheduler_cls in SCHEDULERS:
            scheduler_cls = SCHEDULERS[scheduler_cls]
        elif scheduler_cls in _torch_scheduler_names():
            scheduler_cls = getattr(torch.optim.lr_scheduler, scheduler_cls)
        else:
            valid = ", ".join([*SCHEDULERS, *_torch_scheduler_names()])
            raise UserError(f"--scheduler-cls: unknown scheduler {scheduler_cls!r}; valid names: {valid}")
    if scheduler_cls in SCHEDULERS.values():
        return scheduler_cls(optimizer, num_warmup_steps, num_training_steps, **kwargs)
    try:
        return scheduler_cls(optimizer, **kwargs)
    except TypeError as exc:
        raise UserError(f"{getattr(scheduler_cls, '__name__', scheduler_cls)}: {exc}") from exc
