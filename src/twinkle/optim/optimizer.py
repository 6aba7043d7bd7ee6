"""Resolve an optimizer class by name (``'AdamW'``, ``'Muon'``, any ``torch.optim`` class) or use a class."""

import inspect
from collections.abc import Iterable
from typing import Any

import torch

from twinkle.utils.errors import UserError


def optimizer_names() -> list[str]:
    return sorted(
        name
        for name, obj in vars(torch.optim).items()
        if inspect.isclass(obj)
        and issubclass(obj, torch.optim.Optimizer)
        and obj is not torch.optim.Optimizer
    )


def resolve_optimizer_cls(optimizer_cls: str | type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    if inspect.isclass(optimizer_cls) and issubclass(optimizer_cls, torch.optim.Optimizer):
        return optimizer_cls
    if isinstance(optimizer_cls, str) and optimizer_cls in optimizer_names():
        return getattr(torch.optim, optimizer_cls)
    raise UserError(f"unknown optimizer {optimizer_cls!r}; valid names: {', '.join(optimizer_names())}")


def build_optimizer(
    optimizer_cls: str | type[torch.optim.Optimizer],
    params: Iterable[torch.nn.Parameter],
    lr: float,
    **kwargs: Any,
) -> torch.optim.Optimizer:
    """Create the optimizer over ``params``; extra keyword arguments go to its constructor."""
    cls = resolve_optimizer_cls(optimizer_cls)
    params = list(params)
    if not params:
        raise UserError("no trainable parameters: add a LoRA adapter before set_optimizer()")
    try:
        return cls(params, lr=lr, **kwargs)
    except TypeError as exc:
        raise UserError(f"{cls.__name__} does not accept these arguments ({exc})") from exc
