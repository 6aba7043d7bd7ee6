"""Evaluation with the LoRA adapters off (``forward_only(disable_lora=True)``, which then runs the
plain evaluation's supervised-rows path), or with each row of a batch through its own adapter and
the per-token log-probabilities such a pass returns (``forward_only(adapter_names=[...])``).

Both modes set PEFT's per-layer flags directly and put them back after the pass: PEFT's own
``disable_adapter()`` / ``set_adapter`` also switch the adapters' ``requires_grad``, which would
change what the optimizer and FSDP2 see. A mixed batch runs PEFT's mixed-batch LoRA forward
(``adapter_names=`` on each LoRA layer: every row gets its own adapter's product, rows of the
same adapter together); the fused LoRA nodes stand aside for it, as they take one adapter only."""

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from twinkle.model.forward import loss_and_view
from twinkle.model.outputs import label_logps

BASE_ROW = "__base__"  # PEFT's name for a row without adapter in a mixed batch


def _lora_layers(model: Any) -> list[Any]:
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


@contextlib.contextmanager
def adapters_off(model: Any) -> Iterator[None]:
    """Every LoRA layer computes its base layer only (the base model's outputs)."""
    layers = _lora_layers(model)
    saved = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer, flag in zip(layers, saved, strict=True):
            layer._disable_adapters = flag


@contextlib.contextmanager
def adapter_per_row(model: Any, names: Sequence[str]) -> Iterator[None]:
    """Row i of every LoRA layer's input runs through PEFT adapter ``names[i]`` (``BASE_ROW``:
    none). The layers' active adapters are emptied meanwhile, so no fused node takes the call."""
    layers = _lora_layers(model)
    saved = [layer._active_adapter for layer in layers]
    names = list(names)

    def inject(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, {**kwargs, "adapter_names": names}

    hooks = [layer.register_forward_pre_hook(inject, with_kwargs=True) for layer in layers]
    for layer in layers:
        layer._active_adapter = []
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for layer, active in zip(layers, saved, strict=True):
            layer._active_adapter = active


def loss_and_logps(model: Any, batch: dict[str, torch.Tensor], loss_fn: Any) -> tuple[Any, torch.Tensor]:
    """One unpacked pass over ``batch`` (rows stay rows, so each keeps its adapter): ``loss_fn``'s
    ``LossOutput`` and each label's log-probability, ``(B, L)`` aligned with ``batch["labels"]``
    (0 where a label is -100 or has no prediction: the first position, pads). The pass is the
    plain eval's (``loss_and_view``): a head loss gets the head on the supervised rows only, so no
    ``(B, L, vocab)`` logits are built for it."""
    out, view = loss_and_view(model, batch, loss_fn, padding_free=False)
    return out, label_logps(out, view, batch, lazy=False)
