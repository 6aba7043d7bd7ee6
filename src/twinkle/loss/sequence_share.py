"""Per-sample totals of a rows view whose positions a Ulysses group shares
(``LossView.sequence``, ``twinkle.model.ulysses``).

Under Ulysses each rank of a group holds the same rows and scores a disjoint share of their
positions. A loss that is a sum over tokens needs nothing more: the step sums the ranks' losses,
counts and gradients. A loss over whole samples (a completion's token mean, a pair's summed
log-probabilities) first totals each sample's per-token sums over the group (``total``); then
every rank of the group holds the same per-sample values and computes the same loss from them.

That loss is counted once (``once``, ``count_once``): its value and count on the group's first
rank, 0 elsewhere, so the step's sum over ranks is the one-process loss. Its gradient is kept on
every rank: ``total``'s backward hands each rank the gradient of the totals for its own share of
the sums, unchanged, so the gradients the step sums over the ranks add up to the one-process
gradient, each rank contributing the part that flows through its own positions. A backward
without a collective keeps the group's ranks free of an ordering the layers' all-to-alls would
have to agree with."""

from typing import Any

import torch
import torch.distributed as dist


class _Total(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, values: torch.Tensor, group: Any) -> torch.Tensor:
        out = values.detach().clone().contiguous()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group.group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def total(values: torch.Tensor, sequence: Any) -> torch.Tensor:
    """``values`` (this rank's per-sample sums) summed over the ``sequence`` group
    (a ``twinkle.distributed.sequence_parallel.SequenceGroup``; None: ``values`` as they are)."""
    return values if sequence is None else _Total.apply(values, sequence)


def once(value: torch.Tensor, sequence: Any) -> torch.Tensor:
    """A value every rank of the group computed alike: itself on the first rank, elsewhere 0 with
    the same gradient."""
    if sequence is None or sequence.rank == 0:
        return value
    return value - value.detach()


def count_once(count: Any, sequence: Any) -> Any:
    """A count every rank of the group computed alike: itself on the first rank, 0 elsewhere."""
    if sequence is None or sequence.rank == 0:
        return count
    return count * 0
