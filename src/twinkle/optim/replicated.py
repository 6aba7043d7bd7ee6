"""``ReplicatedOptimizer``: run any optimizer on whole LoRA matrices while the model is sharded.

LoRA's trainable weights are small (a few MB), so every rank keeps a full-size copy of them
and runs the user's optimizer on those copies: gradients are gathered to full size, the step
runs exactly as it would in one process, and each rank copies its shard of the result back
into the sharded parameter. This keeps Muon's Newton-Schulz orthogonalisation on whole
matrices (on sharded DTensors it runs collective by collective, many times slower) and makes the
update identical to a single process. Its state dict is the same on every rank."""

from collections.abc import Callable
from typing import Any

import torch


def _local_shard(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


class ReplicatedOptimizer:
    """Wraps ``optimizer_cls`` built over full copies of ``params`` (DTensors or plain tensors)."""

    def __init__(self, params: list[torch.nn.Parameter], build: Callable[[list[torch.nn.Parameter]], Any]):
        self.params = params
        # Nothing sharded (one process, or plain DDP-style replicas): step the parameters themselves.
        self.direct = not any(hasattr(p, "full_tensor") for p in params)
        if self.direct:
            self.copies = list(params)
        else:
            self.copies = [
                torch.nn.Parameter(
                    p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone()
                )
                for p in params
            ]
        self.optimizer = build(self.copies)

    # what the training step reads
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def gather_grads(self, scale: float) -> None:
        """Full-size gradients onto the copies, multiplied by ``scale``."""
        if self.direct:
            grads = [p.grad for p in self.params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, scale)
            return
        for p, c in zip(self.params, self.copies, strict=True):
            if p.grad is None:
                c.grad = None
                continue
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            c.grad = g.detach().to(c.dtype) * scale

    @torch.no_grad()
    def step(self) -> None:
        self.optimizer.step()
        if self.direct:
            return
        for p, c in zip(self.params, self.copies, strict=True):
            if hasattr(p, "to_local"):
                p.to_local().copy_(_local_shard(c.detach(), p))
            else:
                p.copy_(c)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def sync_copies(self) -> None:
        """Refresh the copies from the (possibly just loaded) model weights."""
        if self.direct:
            return
        with torch.no_grad():
            for p, c in zip(self.params, self.copies, strict=True):
                c.copy_(p.full_tensor() if hasattr(p, "full_tensor") else p)
