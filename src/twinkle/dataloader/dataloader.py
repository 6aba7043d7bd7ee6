"""``DataLoader``: one pass over a dataset in global batches; each rank yields its slice."""

from collections.abc import Iterator
from typing import Any

import torch

from twinkle.dataloader.collate import collate
from twinkle.utils.errors import UserError


class DataLoader:
    """Iterate global batches of ``batch_size`` samples; this rank gets the contiguous
    ``batch_size / world_size`` rows at its data rank.

    ``len()`` is the number of global batches in a full pass (the last one may be short; it is
    split as evenly as possible, so a rank's share may be empty). The loader counts the samples
    consumed across all ranks; ``resume_from_checkpoint(n)`` continues with sample ``n``.
    ``shuffle`` draws one fixed permutation from ``seed``, identical on every rank. Iterating
    again after a finished pass starts a new pass (same order); resuming at the end of a pass
    yields nothing (the run was done)."""

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        shuffle: bool = False,
        seed: int = 42,
        drop_last: bool = False,
        world_size: int | None = None,
        rank: int | None = None,
    ):
        if batch_size < 1:
            raise UserError(f"--batch-size must be at least 1, got {batch_size}")
        if world_size is None or rank is None:
            from twinkle.runtime import get_runtime

            rt = get_runtime()
            world_size, rank = rt.world_size, rt.rank
        if batch_size % world_size:
            raise UserError(
                f"--batch-size {batch_size} is the global batch and must be divisible by the "
                f"{world_size} data-parallel ranks; use a multiple of {world_size}"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.world_size = world_size
        self.rank = rank
        self.consumed = 0
        self._finished = False

    def __len__(self) -> int:
        n, b = len(self.dataset), self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def _order(self) -> list[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        generator = torch.Generator().manual_seed(self.seed)
        return torch.randperm(n, generator=generator).tolist()

    def _rank_slice(self, batch: list[int]) -> list[int]:
        base, extra = divmod(len(batch), self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return batch[start : start + base + (self.rank < extra)]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        order = self._order()
        end = min(len(self) * self.batch_size, len(order))
        if self._finished:  # iterating again after a finished pass starts a new one
            self.consumed, self._finished = 0, False
        pad_id = self.dataset.pad_token_id
        while self.consumed < end:
            batch = order[self.consumed : self.consumed + self.batch_size]
            rows = [self.dataset[i] for i in self._rank_slice(batch)]
            self.consumed += len(batch)
            yield collate(rows, pad_id)
        self._finished = True

    def get_state(self) -> dict[str, int]:
        return {"consumed_train_samples": self.consumed}

    def resume_from_checkpoint(self, consumed_train_samples: int) -> None:
        """Skip the first ``consumed_train_samples`` samples of the pass (all ranks together)."""
        if not 0 <= consumed_train_samples <= len(self.dataset):
            raise UserError(
                f"the checkpoint consumed {consumed_train_samples} samples but this dataset has "
                f"{len(self.dataset)}; resume with the same data, or pass --ignore-data-skip"
            )
        self.consumed = consumed_train_samples
        self._finished = False

    def state_dict(self) -> dict[str, int]:
        return self.get_state()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.resume_from_checkpoint(state["consumed_train_samples"])
