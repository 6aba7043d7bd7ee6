"""Optimizers and learning-rate schedules by name or class.

Public names: ``build_optimizer``, ``build_scheduler``, ``CosineWarmupScheduler``,
``LinearWarmupScheduler``, ``SCHEDULERS``."""

from twinkle.optim.optimizer import build_optimizer
from twinkle.optim.scheduler import SCHEDULERS, CosineWarmupScheduler, LinearWarmupScheduler, build_scheduler

__all__ = [
    "build_optimizer",
    "build_scheduler",
    "CosineWarmupScheduler",
    "LinearWarmupScheduler",
    "SCHEDULERS",
]
