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


FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _fused_applies(cls: type, params: list[torch.nn.Parameter]) -> bool:
    """torch's Adam and AdamW have a fused implementation for CPU and CUDA float tensors."""
    if cls not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    return all(p.device.type in ("cpu", "cuda") and p.dtype in FUSED_DTYPES for p in params)


def build_optimizer(
    optimizer_cls: str | type[torch.optim.Optimizer],
    params: Iterable[torch.nn.Parameter],
    lr: float,
    **kwargs: Any,
) -> torch.optim.Optimizer:
    """Create the optimizer over ``params``; extra keyword arguments go to its constructor."""
    from twinkle.kernel.muon import muon_class

    cls = muon_class(resolve_optimizer_cls(optimizer_cls))  # torch's Muon: batched, same results
    params = list(params)
    if not params:
        raise UserError("no trainable parameters: add a LoRA adapter before set_optimizer()")
    if "fused" not in kwargs and "foreach" not in kwargs and _fused_applies(cls, params):
        kwargs["fused"] = True  # one kernel per step instead of ~10 ops per tensor: 4x faster for LoRA
    try:
        return cls(params, lr=lr, **kwargs)
    except TypeError as exc:
        raise UserError(f"{cls.__name__} does not accept these arguments ({exc})") from exc
