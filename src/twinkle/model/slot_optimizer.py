"""``SlotOptimizer``: an adapter's optimizer over the rank-r parts of its slot's weights.

The user's optimizer runs on full-size copies of exactly the parts the adapter uses (``A[:r]``,
``B[:, :r]``; on experts, each expert's: ``twinkle.model.slots.Part``), so it sees the shapes of a plain rank-r adapter: Muon's shape-dependent learning
rate (``adjust_lr_fn``) and orthogonalisation, AdamW's state and the saved optimizer state are
those of a rank-r adapter, not of the ``max_r`` slot. The step writes the copies back into the
slot (each rank its shard under FSDP2); the unused rows and columns stay zero. The rest (the
param groups, ``zero_grad`` of this adapter's gradients only, the state dict) is
``twinkle.optim.replicated.ReplicatedOptimizer``'s, which the training step drives."""

from collections.abc import Callable
from typing import Any

import torch

from twinkle.model.slots import Part, full, write_full
from twinkle.optim.replicated import ReplicatedOptimizer


class SlotOptimizer(ReplicatedOptimizer):
    """``build(copies)`` makes the user's optimizer; ``parts`` pairs each slot weight with the
    part of it the adapter trains."""

    def __init__(
        self,
        parts: list[tuple[torch.nn.Parameter, Part]],
        build: Callable[[list[torch.nn.Parameter]], Any],
    ):
        self.params = [p for p, _ in parts]
        self.slices = [s for _, s in parts]
        self.copies = [
            torch.nn.Parameter(s.of(full(p).detach()).clone())
            for p, s in zip(self.params, self.slices, strict=True)
        ]
        self.direct = False  # the copies are always parts, never the parameters themselves
        self.optimizer = build(self.copies)

    def gather_grads(self, scale: float) -> None:
        """The used parts of the slot's gradients onto the copies, multiplied by ``scale``."""
        for p, c, s in zip(self.params, self.copies, self.slices, strict=True):
            c.grad = None if p.grad is None else s.of(full(p.grad).detach()).to(c.dtype) * scale

    @torch.no_grad()
    def step(self) -> None:
        self.optimizer.step()
        for p, c, s in zip(self.params, self.copies, self.slices, strict=True):
            if hasattr(p, "to_local"):
                value = torch.zeros(p.shape, dtype=c.dtype, device=c.device)
                s.put(value, c)
                write_full(p, value)
            else:
                s.put(p, c)  # on the parameter itself: its version moves, as caches of it check

    def sync_copies(self) -> None:
        """Refresh the copies from the (possibly just loaded) slot weights."""
        with torch.no_grad():
            for p, c, s in zip(self.params, self.copies, self.slices, strict=True):
                c.copy_(s.of(full(p)))
