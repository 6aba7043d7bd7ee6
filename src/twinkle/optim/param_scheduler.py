"""``ParamScheduler``: upstream's ``'default'`` learning-rate schedule (Megatron's
``OptimizerParamScheduler`` keywords): a warm-up from ``init_lr`` to ``max_lr`` over
``lr_warmup_steps``, then a decay to ``min_lr`` over the rest of ``lr_decay_steps``.

Two choices differ from Megatron's, for the rules every schedule here keeps (``scheduler.py``):
the warm-up's first step already runs at ``1 / lr_warmup_steps`` of the way up (Megatron's runs at
``init_lr``, which is 0 by default: a step that changes nothing), and a run past
``lr_decay_steps`` stays at the last step's rate. ``max_lr`` defaults to the optimizer's own
learning rate (Megatron's to 1e-4), so ``set_optimizer(lr=...)`` alone sets the peak. The weight
decay is the optimizer's (``set_optimizer(weight_decay=...)``); its schedule keywords are refused."""

import math

import torch
from torch.optim.lr_scheduler import LRScheduler

from twinkle.utils.errors import UserError

DECAY_STYLES = ("cosine", "linear", "constant", "inverse-square-root")
# Megatron's weight-decay schedule: weight decay is the optimizer's setting here
_WD_KEYWORDS = ("start_wd", "end_wd", "wd_incr_steps")


class ParamScheduler(LRScheduler):
    """Absolute learning rates (the same for every parameter group) per optimizer step."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lr_decay_steps: int,
        max_lr: float | None = None,
        min_lr: float = 0.0,
        init_lr: float = 0.0,
        lr_warmup_steps: int = 0,
        lr_decay_style: str = "cosine",
        wd_incr_style: str = "constant",
        start_wd: float | None = None,
        end_wd: float | None = None,
        wd_incr_steps: int | None = None,
    ):
        given_wd = [
            k for k, v in zip(_WD_KEYWORDS, (start_wd, end_wd, wd_incr_steps), strict=True) if v is not None
        ]
        if given_wd or wd_incr_style != "constant":
            raise UserError(
                f"set_lr_scheduler('default'): {(given_wd or ['wd_incr_style'])[0]} is not supported: the weight "
                "decay is the optimizer's, constant (set_optimizer(..., weight_decay=...))"
            )
        if lr_decay_style not in DECAY_STYLES:
            raise UserError(
                f"set_lr_scheduler('default'): lr_decay_style={lr_decay_style!r} is not one of {', '.join(DECAY_STYLES)}"
            )
        if not isinstance(lr_decay_steps, int) or isinstance(lr_decay_steps, bool) or lr_decay_steps < 1:
            raise UserError(
                f"set_lr_scheduler('default'): lr_decay_steps must be a whole number >= 1, got {lr_decay_steps!r}"
            )
        if not 0 <= lr_warmup_steps <= lr_decay_steps:
            raise UserError(
                f"set_lr_scheduler('default'): lr_warmup_steps={lr_warmup_steps} must be in [0, lr_decay_steps={lr_decay_steps}]"
            )
        self.max_lr = float(optimizer.param_groups[0]["lr"] if max_lr is None else max_lr)
        if not 0 <= min_lr <= self.max_lr or init_lr < 0:
            raise UserError(
                f"set_lr_scheduler('default'): need 0 <= min_lr <= max_lr and init_lr >= 0, got min_lr={min_lr}, "
                f"max_lr={self.max_lr}, init_lr={init_lr}"
            )
        self.min_lr, self.init_lr = float(min_lr), float(init_lr)
        self.lr_warmup_steps, self.lr_decay_steps, self.lr_decay_style = (
            lr_warmup_steps,
            lr_decay_steps,
            lr_decay_style,
        )
        super().__init__(optimizer)

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based)."""
        warmup = self.lr_warmup_steps
        if step < warmup:
            return self.init_lr + (self.max_lr - self.init_lr) * (step + 1) / warmup
        if self.lr_decay_style == "constant":
            return self.max_lr
        step = min(step, self.lr_decay_steps - 1)  # past the horizon: the last step's rate
        if self.lr_decay_style == "inverse-square-root":
            return max(self.min_lr, self.max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(step, 1)))
        ratio = (step - warmup) / max(1, self.lr_decay_steps - warmup)
        coeff = 0.5 * (1 + math.cos(math.pi * ratio)) if self.lr_decay_style == "cosine" else 1 - ratio
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def get_lr(self) -> list[float]:
        return [self.lr_at(self.last_epoch)] * len(self.optimizer.param_groups)
