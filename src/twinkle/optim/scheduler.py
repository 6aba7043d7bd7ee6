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

from twinkle.optim.param_scheduler import ParamScheduler
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


# upstream's names for its Megatron schedule (``twinkle.optim.param_scheduler``)
PARAM_SCHEDULER_NAMES = ("default", "OptimizerParamScheduler")
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


# torch schedules whose horizon a run's step count can give: class name -> its horizon parameter
HORIZONS = {
    "CosineAnnealingLR": "T_max",
    "LinearLR": "total_iters",
    "PolynomialLR": "total_iters",
    "OneCycleLR": "total_steps",
}


def _resolve(scheduler_cls: str | Callable[..., LRScheduler]) -> Callable[..., LRScheduler]:
    if not isinstance(scheduler_cls, str):
        return scheduler_cls
    if scheduler_cls in SCHEDULERS:
        return SCHEDULERS[scheduler_cls]
    if scheduler_cls in PARAM_SCHEDULER_NAMES:
        return ParamScheduler
    if scheduler_cls in _torch_scheduler_names():
        return getattr(torch.optim.lr_scheduler, scheduler_cls)
    valid = ", ".join([*SCHEDULERS, *PARAM_SCHEDULER_NAMES, *_torch_scheduler_names()])
    raise UserError(f"--scheduler-cls: unknown scheduler {scheduler_cls!r}; valid names: {valid}")


def build_scheduler(
    scheduler_cls: str | Callable[..., LRScheduler],
    optimizer: torch.optim.Optimizer,
    num_warmup_steps: int = 0,
    num_training_steps: int | None = None,
    **kwargs: Any,
) -> LRScheduler:
    """The schedule over ``optimizer``'s steps. ``num_training_steps`` is the run's horizon in
    optimizer steps, ``num_warmup_steps`` its warm-up. Our warm-up schedules need the horizon;
    upstream's ``'default'`` (``ParamScheduler``) takes them as its ``lr_decay_steps`` and
    ``lr_warmup_steps`` unless those are given; a ``torch.optim.lr_scheduler`` name or class gets
    its own arguments (``T_max=...``), the horizon filling its horizon parameter (``HORIZONS``)
    when the call leaves it out. A torch schedule has no warm-up, so ``num_warmup_steps > 0`` with
    one is refused."""
    if num_warmup_steps < 0 or (num_training_steps is not None and num_training_steps < 1):
        raise UserError(
            f"need num_warmup_steps >= 0 and num_training_steps >= 1, got {num_warmup_steps} and {num_training_steps}"
        )
    cls = _resolve(scheduler_cls)
    name = getattr(cls, "__name__", str(cls))
    if cls in SCHEDULERS.values():
        if num_training_steps is None:
            raise UserError(
                f"{name} needs num_training_steps (the run's micro-batches, e.g. len(dataloader)) to end where the data ends"
            )
        return cls(optimizer, num_warmup_steps, num_training_steps, **kwargs)
    if cls is ParamScheduler:
        if num_warmup_steps:
            kwargs.setdefault("lr_warmup_steps", num_warmup_steps)
        if num_training_steps is not None:
            kwargs.setdefault("lr_decay_steps", num_training_steps)
        if "lr_decay_steps" not in kwargs:
            raise UserError("set_lr_scheduler('default') needs lr_decay_steps= (or num_training_steps=)")
        return ParamScheduler(optimizer, **kwargs)
    if num_warmup_steps:
        raise UserError(
            f"{name} has no warm-up: use CosineWarmupScheduler or LinearWarmupScheduler for "
            f"num_warmup_steps={num_warmup_steps}, or pass num_warmup_steps=0"
        )
    horizon = HORIZONS.get(name)
    if horizon is not None and num_training_steps is not None and horizon not in kwargs:
        kwargs[horizon] = num_training_steps
    try:
        return cls(optimizer, **kwargs)
    except TypeError as exc:
        raise UserError(f"{name}: {exc}") from exc
