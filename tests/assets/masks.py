"""PEFT's dropout path with the masks the fused nodes drew: record each ``Drop`` the nodes draw,
then hand them, in the same order, to every adapter's dropout module of a PEFT model."""

from typing import Any

import torch
from peft.tuners.lora.layer import LoraLayer
from torch import nn

from twinkle.kernel.lora import dropout


def record(monkeypatch) -> list[dropout.Drop]:
    """Every ``Drop`` drawn from now on, in order (the draws still happen)."""
    drawn: list[dropout.Drop] = []
    real = dropout.draw

    def spy(p: float) -> dropout.Drop:
        drawn.append(real(p))
        return drawn[-1]

    monkeypatch.setattr(dropout, "draw", spy)
    return drawn


class Replay(nn.Module):
    """``nn.Dropout`` that applies the next recorded mask instead of drawing one, as plain torch
    ops: ``x * (mask / (1 - p))``, so autograd differentiates it as it does PEFT's dropout."""

    def __init__(self, queue: list[dropout.Drop]):
        super().__init__()
        self.queue = queue

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        drop = self.queue.pop(0)
        noise = dropout.keep_mask(x.shape, drop, x.device).to(x.dtype) * drop.scale(x.dtype).to(x.device)
        return x * noise


def replay(model: Any, drawn: list[dropout.Drop]) -> list[dropout.Drop]:
    """Give every LoRA layer of ``model`` (PEFT's forward) the recorded masks; returns the queue,
    empty once each mask was used."""
    queue = list(drawn)
    for module in model.modules():
        if isinstance(module, LoraLayer):
            for name, drop in list(module.lora_dropout.items()):
                if isinstance(drop, nn.Dropout):
                    module.lora_dropout[name] = Replay(queue)
    return queue
