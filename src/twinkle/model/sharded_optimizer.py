"""``ShardedOptimizer``: the optimizer of a full-parameter model under FSDP2, on each rank's shards.

Every weight trains, so a full copy of the weights and their optimizer state on every rank (what
``twinkle.optim.replicated.ReplicatedOptimizer`` keeps for the few LoRA weights) would cost what
FSDP2 saves. Here the user's optimizer runs on the sharded parameters themselves (DTensors):
each rank steps its shard, and its state (AdamW's moments) is sharded the same way. An
elementwise optimizer (AdamW, Adam, SGD) gives the update of one process; one that reads whole
matrices (Muon) runs on DTensors, collective by collective.

The training step drives it as it drives ``ReplicatedOptimizer`` (``gather_grads``, ``step``,
``zero_grad``, ``copies`` for clipping, ``sync_copies``). A checkpoint holds the state at full
size, as a single process's (``optimizer.pt``, which rank 0 writes): ``gather_state`` gathers it
on every rank before the save (rank 0 keeps it for ``state_dict``), and ``load_state_dict``
takes the full state on every rank and keeps its own shard of it, without communication."""

from collections.abc import Callable
from typing import Any

import torch


class ShardedOptimizer:
    """``build(params)`` makes the user's optimizer over the sharded ``params``."""

    def __init__(
        self, params: list[torch.nn.Parameter], build: Callable[[list[torch.nn.Parameter]], Any], rank: int
    ):
        self.params = params
        self.copies = params  # clipping reads the gradients of the shards (a norm over every rank)
        self.direct = True
        self.rank = rank
        self.optimizer = build(params)
        self._gathered: dict[str, Any] | None = None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def gather_grads(self, scale: float) -> None:
        """The gradients (each rank's shards) multiplied by ``scale``, in place."""
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(scale)

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def _ordered(self) -> list[torch.nn.Parameter]:
        """The parameters in the order of the state dict's indices."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def full_value(self, param: torch.nn.Parameter, value: Any) -> Any:
        """One state value of ``param`` at full size on the CPU (a collective for a shard's)."""
        if hasattr(value, "full_tensor"):
            return value.full_tensor().detach().to("cpu")
        if isinstance(value, torch.Tensor):
            return value.detach().to("cpu")
        return value

    def gather_state(self) -> None:
        """A collective, every rank: the state at full size on the CPU, kept on rank 0 for the
        next ``state_dict`` (the other ranks drop each tensor once gathered)."""
        state = self.optimizer.state_dict()
        params = self._ordered()
        full: dict[int, dict[str, Any]] = {}
        for index, values in sorted(state["state"].items()):
            full[index] = {key: self.full_value(params[index], value) for key, value in values.items()}
            if self.rank != 0:
                full[index] = {}
        self._gathered = {"state": full, "param_groups": state["param_groups"]} if self.rank == 0 else None

    def state_dict(self) -> dict[str, Any]:
        """The full-size state ``gather_state`` gathered (rank 0; the save calls it there)."""
        assert self._gathered is not None, "gather_state() runs on every rank before state_dict()"
        state, self._gathered = self._gathered, None
        return state

    def local_value(self, param: torch.nn.Parameter, value: Any) -> Any:
        """This rank's part of one full-size state value of ``param`` (its shard's, for a value
        of the parameter's shape), without communication."""
        if (
            hasattr(param, "device_mesh")
            and isinstance(value, torch.Tensor)
            and tuple(value.shape) == tuple(param.shape)
        ):
            from torch.distributed.tensor import distribute_tensor

            return distribute_tensor(
                value.to(param.to_local().device), param.device_mesh, param.placements, src_data_rank=None
            )
        return value

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The full-size state (a single process's, or a save's), each rank keeping its shard."""
        params = self._ordered()
        local = {}
        for index, values in state.get("state", {}).items():
            p = params[int(index)] if 0 <= int(index) < len(params) else None
            local[index] = {
                key: value if p is None else self.local_value(p, value) for key, value in values.items()
            }
        self.optimizer.load_state_dict({**state, "state": local})

    def sync_copies(self) -> None:
        pass  # the parameters are stepped themselves
