"""Full-parameter training under expert parallelism (``DeviceMesh(ep_size=N)``, no adapter).

Each rank holds a contiguous block of every MoE layer's experts (``twinkle.model.expert_parallel``),
which FSDP2 leaves out of its units; here those blocks train on the rank that holds them, beside
FSDP2's shards of every other weight.

Gradient. One process's gradient is the mean over the T supervised tokens of the window. On W
data ranks (``dp_size * fsdp_size``) each rank's backward gives the gradient of the sum over its
own tokens; FSDP2's reduction averages a shard's gradient over the W ranks, and the step then
multiplies every gradient by W / T (``OptimizerStepAPI._reduce_window``). An expert block's
gradient arrives through the exchange's backward from the tokens that every rank of its exchange
group routed to it: the sum over those ranks' tokens. The ranks that hold the same block (W / N
of them, one per exchange group) all-reduce it, which completes the sum over all W ranks' tokens,
and divide it by W: FSDP2's convention, so the common W / T gives one process's gradient. This
runs once per accumulation window, before the step's rescale.

Norm. The blocks' part of the gradient norm is summed over one exchange group (it holds each
block exactly once; the ranks that hold a block hold the same gradient after the all-reduce), and
combined with the norm of FSDP2's shards; both kinds are clipped by the same factor.

Optimizer. The user's optimizer steps each rank's blocks in place (AdamW's moments per block),
alongside the shards (``twinkle.model.sharded_optimizer``); the parameter groups are one
process's, so a checkpoint's optimizer state is one process's: each block's state is gathered to
full size on rank 0 for the save and sliced back on load.

Checkpoint. The model files hold every expert: the blocks are gathered onto rank 0 (over its
exchange group) into the full state dict that ``save_pretrained`` writes; a resume keeps this
rank's block of each full tensor."""

from typing import Any

import torch
import torch.distributed as dist

from twinkle.distributed.mesh import DeviceMesh
from twinkle.model.sharded_optimizer import ShardedOptimizer


def replica_group(mesh: DeviceMesh, rank: int) -> Any:
    """The process group of the ranks that hold the same block as ``rank`` (the expert group of
    consecutive ranks, ``ep_rank = rank // (world / ep_size)``), or None when each block has one
    rank. Every rank creates every group in the same order (``new_group``'s rule): call on all."""
    stride = mesh.world_size // mesh.ep_size
    if stride == 1:
        return None
    mine = None
    for block in range(mesh.ep_size):
        ranks = list(range(block * stride, (block + 1) * stride))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


class ExpertBlocks:
    """This rank's expert blocks of ``lm`` (``ep.params``, under the model's names) and the
    collectives that make them train as one process's whole experts. ``ep`` is the model's
    ``ExpertParallel``, already split."""

    def __init__(self, ep: Any, lm: torch.nn.Module, mesh: DeviceMesh, rank: int):
        self.exchange = ep.group  # one rank per block
        self.start, self.end = ep.block
        self.experts = ep.experts
        ids = {id(p) for p in ep.params}
        self.named = {n: p for n, p in lm.named_parameters() if id(p) in ids}
        self.ids = ids
        self.denominator = mesh.dp_size * mesh.fsdp_size  # FSDP2 averages a shard's gradient over these
        self.replicas = replica_group(mesh, rank)
        # rank 0's exchange group holds every block once: it gathers them for the save
        self.gathers = rank % (mesh.world_size // mesh.ep_size) == 0
        self.rank = rank

    def holds(self, param: torch.Tensor) -> bool:
        return id(param) in self.ids

    def full_shape(self, block: torch.Tensor) -> tuple[int, ...]:
        return (self.experts, *block.shape[1:])

    def count(self) -> int:
        """How many weights the blocks stand for (every expert, counted once)."""
        return sum(p.numel() // p.shape[0] * self.experts for p in self.named.values())

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Each block's gradient summed over the ranks that hold it, divided by the data ranks
        (see the module's docstring). A collective on every rank."""
        for p in self.named.values():
            if p.grad is None:  # every local expert runs each forward; kept for a window without one
                p.grad = torch.zeros_like(p)
            if self.replicas is not None:
                dist.all_reduce(p.grad, group=self.replicas)
            p.grad.div_(self.denominator)

    def norm(self, grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
        """The ``norm_type`` norm of every block's gradient, each block once: this rank's blocks'
        norm combined over its exchange group (a collective on every rank)."""
        device = grads[0].device if grads else torch.device("cpu")
        local = (
            torch.nn.utils.get_total_norm(grads, norm_type).float()
            if grads
            else torch.zeros((), device=device)
        )
        if norm_type == float("inf"):
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.exchange.group)
            return local
        powered = local.pow(norm_type)
        dist.all_reduce(powered, group=self.exchange.group)
        return powered.pow(1.0 / norm_type)

    def slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's block of a full tensor (experts along dim 0)."""
        return full[self.start : self.end]

    def gather(self, block: torch.Tensor) -> torch.Tensor | None:
        """The full tensor on rank 0, on the CPU (None elsewhere): the blocks of rank 0's exchange
        group in order. A collective on that group's ranks; the other ranks return None at once."""
        if not self.gathers:
            return None
        block = block.detach().contiguous()
        parts = [torch.empty_like(block) for _ in range(self.exchange.size)] if self.rank == 0 else None
        dist.gather(block, parts, group_dst=0, group=self.exchange.group)
        return torch.cat(parts).cpu() if parts is not None else None

    def all_gather(self, block: torch.Tensor) -> torch.Tensor:
        """The full tensor on every rank, on the CPU (a collective over the exchange group)."""
        block = block.detach().contiguous()
        parts = [torch.empty_like(block) for _ in range(self.exchange.size)]
        dist.all_gather(parts, block, group=self.exchange.group)
        return torch.cat(parts).cpu()

    def gather_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` (a model state dict, full on rank 0) with every expert at full size on rank 0."""
        for name, p in self.named.items():
            full = self.gather(p)
            if full is not None:
                state[name] = full.to(state[name].dtype) if name in state else full
        return state


class ExpertShardedOptimizer(ShardedOptimizer):
    """``ShardedOptimizer`` over FSDP2's shards and this rank's expert ``blocks``: the blocks'
    gradients reduced once per window, the norm over both kinds, the state at full size in a
    checkpoint."""

    def __init__(self, params: list[torch.nn.Parameter], build: Any, rank: int, blocks: ExpertBlocks):
        super().__init__(params, build, rank)
        self.blocks = blocks

    def gather_grads(self, scale: float) -> None:
        self.blocks.reduce_grads()
        super().gather_grads(scale)

    def step(self) -> None:
        """The user's optimizer stepped twice, once over the shards and once over the blocks, each
        parameter group narrowed to that kind meanwhile: fused and foreach kernels refuse a list
        that mixes DTensors with plain tensors. The groups themselves stay one process's, so the
        schedule sets every weight's rate and a checkpoint's state has one process's layout.
        Every weight keeps its own state, so each is stepped exactly once."""
        groups = self.optimizer.param_groups
        whole = [group["params"] for group in groups]
        try:
            for blocks in (False, True):
                for group, params in zip(groups, whole, strict=True):
                    group["params"] = [p for p in params if self.blocks.holds(p) == blocks]
                self.optimizer.step()
        finally:
            for group, params in zip(groups, whole, strict=True):
                group["params"] = params

    def clip(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip every gradient to ``max_norm`` (0: measure only) by their global ``norm_type``
        norm, each expert block counted once; return the norm before."""
        shards = [p for p in self.params if p.grad is not None and not self.blocks.holds(p)]
        own = [p for p in self.params if p.grad is not None and self.blocks.holds(p)]
        total = self.blocks.norm([p.grad for p in own], norm_type)
        if shards:
            sharded = torch.nn.utils.get_total_norm([p.grad for p in shards], norm_type).full_tensor()
            total = torch.nn.utils.get_total_norm([sharded.to(total.device), total], norm_type)
        limit = max_norm if max_norm > 0 else float("inf")
        for part in (shards, own):  # DTensor and plain gradients do not mix in one foreach
            if part:
                torch.nn.utils.clip_grads_with_norm_(part, limit, total.to(part[0].grad.device))
        return float(total)

    def full_value(self, param: torch.nn.Parameter, value: Any) -> Any:
        if self.blocks.holds(param) and isinstance(value, torch.Tensor) and value.shape == param.shape:
            return self.blocks.gather(value)
        return super().full_value(param, value)

    def local_value(self, param: torch.nn.Parameter, value: Any) -> Any:
        if self.blocks.holds(param) and isinstance(value, torch.Tensor):
            if tuple(value.shape) == self.blocks.full_shape(param):
                return self.blocks.slice(value).to(param.device).clone()
        return super().local_value(param, value)
