"""Checks of the ``DataLoader``'s keywords: which data rank reads, and the keywords it refuses."""

from typing import Any

import torch

from twinkle.utils.errors import UserError


def refuse(batch_sampler: Any, generator: Any, in_order: bool, pin_memory_device: str) -> None:
    """torch keywords whose meaning clashes with global batches split over the ranks."""
    if batch_sampler is not None:
        raise UserError(
            "DataLoader: not supported yet: batch_sampler= (batches are global and split over the "
            "ranks); pass sampler= for the order and batch_size= for the global batch"
        )
    if generator is not None:
        raise UserError("DataLoader: not supported yet: generator=; the order is drawn from seed=")
    if not in_order:
        raise UserError("DataLoader: not supported yet: in_order=False; batches always come in order")
    if pin_memory_device:
        raise UserError(
            "DataLoader: not supported yet: pin_memory_device=; pin_memory=True pins for the device"
        )


def data_rank(device_mesh: Any, world_size: int | None, rank: int | None) -> tuple[int, int]:
    """``(data world size, data rank)``: from ``device_mesh``, else as given, else the runtime's.
    The driver of a single controller reads whole global batches (its methods slice them)."""
    from twinkle.runtime.controller import active  # single-controller hook (twinkle.runtime.remote)

    if active() is not None and rank is None:
        return 1, 0
    if device_mesh is not None:
        if world_size is not None or rank is not None:
            raise UserError("DataLoader: give device_mesh= or world_size=/rank=, not both")
        return device_mesh.data_world_size, device_mesh.data_rank
    if world_size is None or rank is None:
        from twinkle.runtime import get_runtime

        rt = get_runtime()
        return rt.world_size, rt.rank
    return world_size, rank


def check_sampling(
    stream: bool,
    batch_size: int,
    shuffle: bool,
    sampler: Any,
    min_batch_size: int | None,
    max_retries: int,
    shuffle_buffer: int,
) -> None:
    """The order and batching keywords, each refused with the reason."""
    if sampler is not None:
        if stream:
            raise UserError("DataLoader: sampler= needs a dataset with len() and indexing, not a stream")
        if shuffle:
            raise UserError("DataLoader: sampler= and shuffle=True exclude each other; pass one")
        if isinstance(sampler, torch.utils.data.DistributedSampler):
            raise UserError(
                "DataLoader: a DistributedSampler would split the data twice; the loader gives "
                "each rank its slice already, pass a sampler that orders the whole dataset"
            )
    if min_batch_size is not None and not 1 <= min_batch_size <= batch_size:
        raise UserError(f"DataLoader: min_batch_size must be in 1..{batch_size}, got {min_batch_size}")
    if max_retries < 0:
        raise UserError(f"DataLoader: max_retries must be 0 or more, got {max_retries}")
    if shuffle_buffer < 1:
        raise UserError(f"DataLoader: shuffle_buffer must be at least 1, got {shuffle_buffer}")


def check_workers(
    num_workers: int, prefetch_factor: int | None, persistent_workers: bool, timeout: float
) -> None:
    if num_workers < 0:
        raise UserError(f"DataLoader: num_workers must be 0 or more, got {num_workers}")
    if num_workers == 0 and (prefetch_factor is not None or persistent_workers):
        name = "prefetch_factor" if prefetch_factor is not None else "persistent_workers"
        raise UserError(f"DataLoader: {name}= needs num_workers > 0")
    if timeout < 0:
        raise UserError(f"DataLoader: timeout must be 0 or more, got {timeout}")
