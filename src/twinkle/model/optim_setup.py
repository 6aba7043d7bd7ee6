"""What ``set_optimizer`` and ``set_lr_scheduler`` do with an adapter's group, apart from the
facade: upstream's names resolved (``'default'``: ``twinkle.optim.default_optimizer`` and
``twinkle.optim.param_scheduler``), the schedule's horizon turned from micro-batches into
optimizer steps."""

from typing import Any

from twinkle.model.train_state import OptimizerGroup
from twinkle.optim import build_optimizer, build_scheduler, default_optimizer_args
from twinkle.optim.default_optimizer import NAMES as DEFAULT_OPTIMIZERS
from twinkle.utils.errors import UserError


def optimizer_builder(group: OptimizerGroup, optimizer_cls: Any, lr: float, kwargs: dict[str, Any]):
    """The function the adapters call with the weights to step. Upstream's ``'default'``
    optimizer's ``clip_grad`` becomes the group's clipping norm (``clip_grad_norm``'s default),
    as Megatron's optimizer clips at its own step."""
    if isinstance(optimizer_cls, str) and optimizer_cls in DEFAULT_OPTIMIZERS:
        kwargs, clip_grad = default_optimizer_args(kwargs)
        if clip_grad is not None:
            if clip_grad < 0:
                raise UserError(
                    f"set_optimizer('default'): clip_grad must be >= 0 (0: no clipping), got {clip_grad}"
                )
            group.max_grad_norm = float(clip_grad)
        optimizer_cls = "AdamW"
    return lambda params: build_optimizer(optimizer_cls, params, lr=lr, **kwargs)


def attach_scheduler(
    group: OptimizerGroup,
    scheduler_cls: Any,
    num_warmup_steps: int,
    num_training_steps: int | None,
    kwargs: dict[str, Any],
) -> None:
    """``num_training_steps`` counts micro-batches (``len(dataloader)``); the schedule runs over
    the optimizer steps they make, so it ends where the data ends. Without it (a torch schedule
    with its own ``T_max``, upstream's ``'default'`` with ``lr_decay_steps``) the schedule's own
    arguments count optimizer steps, as they do in torch."""
    if group.optimizer is None:
        raise UserError("call set_optimizer(...) before set_lr_scheduler(...)")
    optimizer_steps = None
    if num_training_steps is not None:
        if (
            isinstance(num_training_steps, bool)
            or not isinstance(num_training_steps, int)
            or num_training_steps < 1
        ):
            raise UserError(f"num_training_steps must be a whole number >= 1, got {num_training_steps!r}")
        group.num_training_steps = num_training_steps
        optimizer_steps = -(-num_training_steps // group.gradient_accumulation_steps)
    group.lr_scheduler = build_scheduler(
        scheduler_cls, group.optimizer.optimizer, num_warmup_steps, optimizer_steps, **kwargs
    )
    group.last_lr = group.optimizer.param_groups[0]["lr"]


def set_window(group: OptimizerGroup, gradient_accumulation_steps: int | None) -> None:
    """``clip_grad_and_step(gradient_accumulation_steps=N)``, upstream's per-call window: the
    adapter's window becomes N micro-batches. It may change only between windows, as a window
    already open was counted against the old length."""
    if (
        gradient_accumulation_steps is None
        or gradient_accumulation_steps == group.gradient_accumulation_steps
    ):
        return
    if (
        isinstance(gradient_accumulation_steps, bool)
        or not isinstance(gradient_accumulation_steps, int)
        or gradient_accumulation_steps < 1
    ):
        raise UserError(
            f"gradient_accumulation_steps must be a whole number >= 1, got {gradient_accumulation_steps!r}"
        )
    if group.window_batches > gradient_accumulation_steps:
        raise UserError(
            f"gradient_accumulation_steps={gradient_accumulation_steps}: the open window already holds "
            f"{group.window_batches} micro-batches of the adapter's {group.gradient_accumulation_steps}; pass the "
            "same value on every call, or give it once to add_adapter_to_model(..., gradient_accumulation_steps=)"
        )
    group.gradient_accumulation_steps = gradient_accumulation_steps
