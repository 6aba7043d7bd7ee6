"""Resolve an optimizer class by name (``'AdamW'``, ``'Muon'``, any ``torch.optim`` class) or use a class."""

import inspect
from collections.abc import Iterable
from typing import Any

import torch

from twinkle.optim.default_optimizer import NAMES as DEFAULT_NAMES
from twinkle.optim.default_optimizer import default_optimizer_args
from twinkle.utils.errors import UserError

# torch.optim classes the training step cannot drive, and why: it calls ``step()`` without a
# closure, on the dense gradients of the LoRA weights.
UNUSABLE = {
    "LBFGS": "its step() needs a closure that recomputes the loss, and the training step passes none",
    "SparseAdam": "it takes sparse gradients only, and LoRA gradients are dense",
}


def optimizer_names() -> list[str]:
    """The ``torch.optim`` classes that can train here (every one but ``UNUSABLE``)."""
    return sorted(
        name
        for name, obj in vars(torch.optim).items()
        if inspect.isclass(obj)
        and issubclass(obj, torch.optim.Optimizer)
        and obj is not torch.optim.Optimizer
        and name not in UNUSABLE
    )


def _refuse_unusable(cls: type, prefix: str) -> None:
    for name, why in UNUSABLE.items():
        if hasattr(torch.optim, name) and issubclass(cls, getattr(torch.optim, name)):
            raise UserError(
                f"{prefix}optimizer {cls.__name__} cannot train here ({why}); "
                f"use one of {', '.join(optimizer_names())}"
            )


def resolve_optimizer_cls(
    optimizer_cls: str | type[torch.optim.Optimizer], label: str | None = None
) -> type[torch.optim.Optimizer]:
    """The class named by ``optimizer_cls`` (a ``torch.optim`` name) or ``optimizer_cls`` itself;
    an unknown name, or a class the training step cannot drive (``UNUSABLE``), is a ``UserError``
    (prefixed by ``label``, the flag it came from, when given)."""
    prefix = f"{label}: " if label else ""
    if isinstance(optimizer_cls, str) and optimizer_cls in DEFAULT_NAMES:
        return torch.optim.AdamW  # upstream's 'default' (twinkle.optim.default_optimizer)
    if isinstance(optimizer_cls, str) and optimizer_cls in UNUSABLE:
        optimizer_cls = getattr(torch.optim, optimizer_cls, optimizer_cls)
    if inspect.isclass(optimizer_cls) and issubclass(optimizer_cls, torch.optim.Optimizer):
        _refuse_unusable(optimizer_cls, prefix)
        return optimizer_cls
    if isinstance(optimizer_cls, str) and optimizer_cls in optimizer_names():
        return getattr(torch.optim, optimizer_cls)
    raise UserError(
        f"{prefix}unknown optimizer {optimizer_cls!r}; valid names: {', '.join([*DEFAULT_NAMES, *optimizer_names()])}"
    )


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
    """Create the optimizer over ``params``; extra keyword arguments go to its constructor
    (upstream's ``'default'``: Megatron's keywords, ``twinkle.optim.default_optimizer``)."""
    from twinkle.kernel.muon import muon_class

    if isinstance(optimizer_cls, str) and optimizer_cls in DEFAULT_NAMES:
        kwargs, clip_grad = default_optimizer_args(kwargs)
        if clip_grad is not None:
            raise UserError(
                "clip_grad is the model's gradient clipping: pass it to model.set_optimizer('default', clip_grad=...)"
            )

    cls = muon_class(resolve_optimizer_cls(optimizer_cls))  # torch's Muon: batched, same results
    params = list(params)
    if not params:
        raise UserError("no trainable parameters: add a LoRA adapter before set_optimizer()")
    if "fused" not in kwargs and "foreach" not in kwargs and _fused_applies(cls, params):
        kwargs["fused"] = (
            True  # one kernel per step instead of ~10 ops per tensor, for many small LoRA tensors
        )
    try:
        return cls(params, lr=lr, **kwargs)
    except TypeError as exc:
        raise UserError(f"{cls.__name__} does not accept these arguments ({exc})") from exc
