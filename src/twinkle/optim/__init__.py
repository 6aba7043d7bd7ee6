"""Optimizers and learning-rate schedules by name or class.

Public names: ``build_optimizer``, ``build_scheduler``, ``CosineWarmupScheduler``,
``LinearWarmupScheduler``, ``ParamScheduler`` (upstream's ``'default'`` schedule), ``SCHEDULERS``,
``default_optimizer_args`` (upstream's ``'default'`` optimizer keywords as AdamW's)."""

from twinkle.optim.default_optimizer import default_optimizer_args
from twinkle.optim.optimizer import build_optimizer
from twinkle.optim.param_scheduler import ParamScheduler
from twinkle.optim.scheduler import SCHEDULERS, CosineWarmupScheduler, LinearWarmupScheduler, build_scheduler

__all__ = [
    "build_optimizer",
    "build_scheduler",
    "CosineWarmupScheduler",
    "LinearWarmupScheduler",
    "ParamScheduler",
    "SCHEDULERS",
    "default_optimizer_args",
]
