"""Ulysses sequence parallelism's groups and collectives.

The ``ulysses_size`` ranks of a group read the same rows (``DeviceMesh``: consecutive data ranks)
and each runs one contiguous share of the positions through the layers. Attention needs every
position, so it trades the share of positions for a share of the heads over the whole sequence
(``seq_to_heads``) and back (``heads_to_seq``). Both are all-to-alls whose backward is the
reverse all-to-all, so gradients reach every rank's positions. ``all_to_all_single`` runs on
gloo (CPU) and nccl (CUDA) alike.

``sequence_group`` builds this rank's group from a mesh; ``gather_rows`` collects a tensor of
rows from each rank of the group (no gradient), for outputs read after the step."""

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from twinkle.distributed.mesh import DeviceMesh


@dataclass(frozen=True)
class SequenceGroup:
    """This rank's Ulysses group: ``size`` ranks, this one at ``rank`` (its share of the positions
    is the ``rank``-th of ``size``), ``group`` the torch process group."""

    size: int
    rank: int
    group: Any


def sequence_group(mesh: DeviceMesh, rank: int) -> SequenceGroup | None:
    """This rank's group under ``mesh`` (None when ``ulysses_size`` is 1). Every rank creates
    every group, in the same order, as ``torch.distributed.new_group`` requires: call it on all
    ranks at once."""
    if mesh.ulysses_size == 1:
        return None
    members: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for r in range(mesh.world_size):
        where = mesh.rank_coordinates(r)
        key = (where["pp"], where["data"], where["cp"], where["tp"])
        members.setdefault(key, []).append((where["ulysses"], r))
    mine = None
    for key in sorted(members):
        ranks = [r for _, r in sorted(members[key])]
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = SequenceGroup(len(ranks), ranks.index(rank), group)
    assert mine is not None, f"rank {rank} is in no Ulysses group of {mesh.describe()}"
    return mine


def _exchange(x: torch.Tensor, scatter_dim: int, gather_dim: int, sg: SequenceGroup) -> torch.Tensor:
    """Split ``x`` along ``scatter_dim`` into ``size`` parts, part j to rank j; join the parts
    received along ``gather_dim``, in rank order."""
    send = x.movedim(scatter_dim, 0).contiguous()
    if send.shape[0] % sg.size:
        raise ValueError(
            f"Ulysses all-to-all: dimension {scatter_dim} of {tuple(x.shape)} is not a multiple of {sg.size}"
        )
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=sg.group)
    parts = received.chunk(sg.size, dim=0)  # part i: rank i's share along gather_dim
    return torch.cat([p.movedim(0, scatter_dim) for p in parts], dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, scatter_dim: int, gather_dim: int, sg: SequenceGroup
    ) -> torch.Tensor:
        ctx.dims, ctx.sg = (scatter_dim, gather_dim), sg
        return _exchange(x, scatter_dim, gather_dim, sg)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        scatter_dim, gather_dim = ctx.dims
        return _exchange(grad, gather_dim, scatter_dim, ctx.sg), None, None, None


def seq_to_heads(x: torch.Tensor, sg: SequenceGroup) -> torch.Tensor:
    """``(B, heads, positions / size, D)`` -> ``(B, heads / size, positions, D)``."""
    return _AllToAll.apply(x, 1, 2, sg)


def heads_to_seq(x: torch.Tensor, sg: SequenceGroup) -> torch.Tensor:
    """``(B, positions, heads / size, D)`` -> ``(B, positions / size, heads, D)``."""
    return _AllToAll.apply(x, 1, 2, sg)


def gather_rows(x: torch.Tensor, sg: SequenceGroup) -> list[torch.Tensor]:
    """Every rank's ``x`` (rows along dim 0, any count; the other dims equal), in rank order,
    without gradient."""
    x = x.detach().contiguous()
    count = torch.tensor([x.shape[0]], device=x.device)
    counts = [torch.zeros_like(count) for _ in range(sg.size)]
    dist.all_gather(counts, count, group=sg.group)
    sizes = [int(c) for c in counts]
    padded = x.new_zeros((max(1, *sizes), *x.shape[1:]))
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(sg.size)]
    dist.all_gather(parts, padded, group=sg.group)
    return [p[:n] for p, n in zip(parts, sizes, strict=True)]
