"""Expert parallelism's groups and collectives.

``DeviceMesh(ep_size=N)`` splits the world into N expert groups of consecutive ranks
(``ep_rank = rank // (world / N)``); the ranks of one expert group hold the same experts (the
``ep_rank``-th of N contiguous blocks). Tokens travel between ranks that hold different experts:
the ranks ``r, r + world / N, ...``, one of each expert group, form an exchange group. A token
routed to expert ``e`` is sent to the member holding ``e`` and its output comes back the same
way, with ``all_to_all_single`` on uneven splits (gloo on CPU, nccl on CUDA). The backward of
each exchange is the reverse exchange, so gradients reach the rank that sent the token."""

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from twinkle.distributed.mesh import DeviceMesh


@dataclass(frozen=True)
class ExpertGroup:
    """This rank's exchange group: ``size`` ranks, one per expert block, this one at ``rank``
    (it holds the ``rank``-th block of experts); ``group``: the torch process group."""

    size: int
    rank: int
    group: Any


def expert_group(mesh: DeviceMesh, rank: int) -> ExpertGroup | None:
    """This rank's exchange group under ``mesh`` (None when ``ep_size`` is 1). Every rank creates
    every group in the same order, as ``torch.distributed.new_group`` requires: call it on all
    ranks at once."""
    if mesh.ep_size == 1:
        return None
    stride = mesh.world_size // mesh.ep_size
    mine = None
    for offset in range(stride):
        ranks = list(range(offset, mesh.world_size, stride))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = ExpertGroup(len(ranks), ranks.index(rank), group)
    assert mine is not None and mine.rank == mesh.rank_coordinates(rank)["ep"]
    return mine


def exchange_counts(counts: torch.Tensor, eg: ExpertGroup) -> torch.Tensor:
    """``counts`` ``(size, n)``: row j for rank j; returns ``(size, n)``, row j from rank j."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=eg.group)
    return received


def _exchange(x: torch.Tensor, send: list[int], receive: list[int], eg: ExpertGroup) -> torch.Tensor:
    out = x.new_empty((sum(receive), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), receive, send, group=eg.group)
    return out


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, send: list[int], receive: list[int], eg: ExpertGroup
    ) -> torch.Tensor:
        ctx.splits, ctx.eg = (send, receive), eg
        return _exchange(x, send, receive, eg)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        send, receive = ctx.splits
        return _exchange(grad, receive, send, ctx.eg), None, None, None


def exchange_rows(x: torch.Tensor, send: list[int], receive: list[int], eg: ExpertGroup) -> torch.Tensor:
    """Send the first ``send[0]`` rows of ``x`` to rank 0, the next ``send[1]`` to rank 1, ...;
    returns the rows received (``receive[j]`` from rank j, in rank order), with gradient."""
    return _Exchange.apply(x, send, receive, eg)
