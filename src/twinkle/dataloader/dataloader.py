"""``DataLoader``: one pass over a dataset in global batches; each rank yields its slice."""

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from twinkle.dataloader.fetch import Fetched, Fetcher, as_is, rows_as_is
from twinkle.dataloader.options import check_sampling, check_workers, data_rank, refuse
from twinkle.dataloader.steps import Step, buffer_shuffle, index_steps, stream_steps
from twinkle.processor.base import InputProcessor, processor_class
from twinkle.runtime.remote import remote_class  # remote_group= hook
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

logger = get_logger()


class NoLengthError(UserError, TypeError):
    """``len()`` of a loader over a stream. A ``TypeError`` too, so ``list(loader)`` (which asks
    for a length hint and takes a ``TypeError`` as "unknown") still works."""


def _is_dataset(obj: Any) -> bool:
    return hasattr(obj, "__getitem__") or hasattr(obj, "__iter__")


@remote_class  # remote_group=: built on a device group's ranks (twinkle.runtime.remote)
class DataLoader:
    """Iterate global batches of ``batch_size`` samples; this rank gets the contiguous
    ``batch_size / world_size`` rows at its data rank (from ``device_mesh`` when given, else
    ``world_size``/``rank``, else the runtime).

    ``len()`` is the number of global batches in a full pass (the last one may be short; it is
    split as evenly as possible, so a rank's share may be empty). The loader counts the samples
    consumed across all ranks; ``resume_from_checkpoint(n)`` continues with sample ``n``.
    ``shuffle`` draws one fixed permutation from ``seed``, identical on every rank (``sampler``
    gives an order of your own instead: the same on every rank, not split by rank). Iterating
    again after a finished pass starts a new pass (same order); resuming at the end of a pass
    yields nothing (the run was done).

    A dataset without ``len`` (``twinkle.dataset.iterable.IterableDataset``, any iterable) is
    read as a stream: every rank reads it in the same order and keeps its slice of each global
    batch; ``shuffle`` is a buffer shuffle (``shuffle_buffer`` rows) under ``seed``; resuming
    reads and discards the consumed rows. A row that encoding drops leaves its batch one short.

    A batch is this rank's rows, a list of dicts (encoded samples once the dataset is
    encoded), as upstream's loader yields them: the model's processor turns them into tensors
    inside its step (``TransformersModel.set_processor``; ``InputProcessor`` by default), which
    is where a padding-free model packs them. ``collate_fn=`` or ``set_processor(...)`` make the
    batch what they return instead (``collate_fn`` wins). ``num_workers`` reads (and, for a
    stream, preprocesses and encodes) the rows in torch worker processes, giving the same batches
    in the same order. A row whose read raises is tried ``max_retries`` more times, then left out
    with a warning and counted in ``skipped_samples``; rows the dataset itself leaves out
    (``skip_bad_rows``) are counted in its ``skipped_rows``, in this process even when workers
    read them. A global batch shorter than
    ``min_batch_size`` ends the pass.

    Over encoded preference pairs (rows ``{'positive', 'negative'}``, see ``Dataset.encode``)
    ``batch_size`` counts pairs, as upstream's DPO recipe does: a rank's share is whole pairs,
    yielded as pair rows (the model's processor lays each pair out as its two sides next to each
    other, ``twinkle.processor.collate``), so no pair is ever split between ranks."""

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        shuffle: bool = False,
        seed: int = 42,
        drop_last: bool = False,
        world_size: int | None = None,
        rank: int | None = None,
        *,
        device_mesh: Any = None,
        sampler: Iterable[int] | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
        min_batch_size: int | None = None,
        max_retries: int = 20,
        shuffle_buffer: int = 1000,
        pin_memory: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        batch_sampler: Any = None,
        generator: Any = None,
        in_order: bool = True,
        pin_memory_device: str = "",
    ):
        refuse(batch_sampler, generator, in_order, pin_memory_device)
        if callable(dataset) and not _is_dataset(dataset):
            dataset = dataset()  # upstream's form: a function that builds the dataset
        if batch_size < 1:
            raise UserError(f"--batch-size must be at least 1, got {batch_size}")
        world_size, rank = data_rank(device_mesh, world_size, rank)
        if batch_size % world_size:
            raise UserError(
                f"--batch-size {batch_size} is the global batch and must be divisible by the "
                f"{world_size} data-parallel ranks; use a multiple of {world_size}"
            )
        self.stream = not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"))
        check_sampling(self.stream, batch_size, shuffle, sampler, min_batch_size, max_retries, shuffle_buffer)
        check_workers(num_workers, prefetch_factor, persistent_workers, timeout)
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.world_size = world_size
        self.rank = rank
        self.device_mesh = device_mesh
        self.sampler = sampler
        self.collate_fn = collate_fn
        self.min_batch_size = min_batch_size
        self.max_retries = max_retries
        self.shuffle_buffer = shuffle_buffer
        self.num_workers = num_workers
        self._torch_options = {
            "num_workers": num_workers,
            "pin_memory": pin_memory,
            "timeout": timeout,
            "worker_init_fn": worker_init_fn,
            "multiprocessing_context": multiprocessing_context,
            "prefetch_factor": prefetch_factor,
            "persistent_workers": persistent_workers,
        }
        self.processor: Callable[[list[Any]], Any] | None = None
        self.skipped_samples = 0
        self.consumed = 0
        self._finished = False
        self._torch_loader: torch.utils.data.DataLoader | None = None

    # ------------------------------------------------------------------ the order of a pass

    def _num_samples(self) -> int:
        if self.sampler is None:
            return len(self.dataset)
        return len(self.sampler) if hasattr(self.sampler, "__len__") else len(list(self.sampler))

    def _min_last(self) -> int:
        """The fewest samples a last global batch may have and still be read."""
        return self.batch_size if self.drop_last else (self.min_batch_size or 1)

    def __len__(self) -> int:
        if self.stream:
            raise NoLengthError(
                "DataLoader: a streamed dataset has no length; give the scheduler its number of steps yourself"
            )
        full, rest = divmod(self._num_samples(), self.batch_size)
        return full + (0 < rest and rest >= self._min_last())

    def _order(self) -> list[int]:
        if self.sampler is not None:
            return [int(i) for i in self.sampler]
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        generator = torch.Generator().manual_seed(self.seed)
        return torch.randperm(n, generator=generator).tolist()

    def _stream_rows(self) -> Iterator[tuple[int, Any]]:
        raw_rows = getattr(self.dataset, "raw_rows", None)
        rows = raw_rows() if raw_rows is not None else enumerate(iter(self.dataset))
        return buffer_shuffle(rows, self.shuffle_buffer, self.seed) if self.shuffle else rows

    def _plan(self) -> Iterator[Step]:
        """The steps left in this pass, from the consumed count."""
        if self.stream:
            return stream_steps(
                self._stream_rows(),
                self.consumed,
                self.batch_size,
                self._min_last(),
                self.rank,
                self.world_size,
            )
        order = self._order()
        end = min(len(self) * self.batch_size, len(order))
        return index_steps(order, self.consumed, end, self.batch_size, self.rank, self.world_size)

    # ------------------------------------------------------------------ reading the batches

    def _collate(self) -> Callable[[list[Any]], Any]:
        if self.collate_fn is not None:
            return self.collate_fn
        if self.processor is not None:
            return self.processor
        return rows_as_is

    def _fetched(self) -> Iterator[Fetched]:
        fetcher = Fetcher(self.dataset, self._collate(), self.max_retries, self.stream)
        if self.num_workers == 0 and not self._torch_options["pin_memory"]:
            return map(fetcher, self._plan())
        # persistent workers live as long as the torch loader: keep it (``set_processor`` drops it)
        if self._torch_loader is None or not self._torch_options["persistent_workers"]:
            self._torch_loader = torch.utils.data.DataLoader(
                fetcher,
                sampler=_Plan(self),
                batch_size=None,
                collate_fn=as_is,
                # torch draws its workers' base seed from this, not from the global generator,
                # so a pass leaves the run's random state as it was
                generator=torch.Generator().manual_seed(self.seed),
                **self._torch_options,
            )
        return iter(self._torch_loader)

    def __iter__(self) -> Iterator[Any]:
        if self._finished:  # iterating again after a finished pass starts a new one
            self.consumed, self._finished = 0, False
        in_workers = self.num_workers > 0
        for batch, size, failed, skipped in self._fetched():
            if in_workers and skipped:  # counted on a worker's copy of the dataset (fetch.py)
                self.dataset.skipped_rows += skipped
            for reason in failed:
                self.skipped_samples += 1
                logger.warning(
                    f"DataLoader: skipped {reason} after {self.max_retries + 1} tries "
                    f"({self.skipped_samples} skipped so far)"
                )
            self.consumed += size
            yield batch
        self._finished = True

    def set_processor(self, processor_cls: Any, **kwargs: Any) -> None:
        """Turn each rank's rows into its batch with ``processor_cls``: a processor name
        (``'InputProcessor'``), a class built with ``kwargs`` or a callable, in place of yielding
        the rows; ``collate_fn=`` still wins. An ``InputProcessor`` built here pads with the
        dataset's pad token unless ``pad_token_id`` is given. It applies from the next ``iter()``."""
        if isinstance(processor_cls, str):
            processor_cls = processor_class(processor_cls, "DataLoader.set_processor")
        if not isinstance(processor_cls, type) and kwargs:
            raise UserError("DataLoader.set_processor: keyword arguments go with a class, not an instance")
        if isinstance(processor_cls, type):
            if issubclass(processor_cls, InputProcessor) and "pad_token_id" not in kwargs:
                kwargs["pad_token_id"] = self._pad_token_id()
            try:
                processor = processor_cls(**kwargs)
            except TypeError as exc:
                raise UserError(f"DataLoader.set_processor({processor_cls.__name__}): {exc}") from exc
        else:
            processor = processor_cls
        if not callable(processor):
            raise UserError(f"DataLoader.set_processor: {type(processor).__name__} is not callable")
        self.processor = processor
        self._torch_loader = None  # persistent workers hold the old collate function

    def _pad_token_id(self) -> int | None:
        """The dataset's pad token (None where it has none, a ``Dataset`` without a template:
        pads are then 0)."""
        try:
            return getattr(self.dataset, "pad_token_id", None)
        except UserError:
            return None

    # ------------------------------------------------------------------ state

    def get_state(self) -> dict[str, int]:
        return {"consumed_train_samples": self.consumed}

    def resume_from_checkpoint(self, consumed_train_samples: int) -> None:
        """Skip the first ``consumed_train_samples`` samples of the pass (all ranks together)."""
        if consumed_train_samples < 0:
            raise UserError(f"consumed_train_samples must be 0 or more, got {consumed_train_samples}")
        if not self.stream and consumed_train_samples > self._num_samples():
            raise UserError(
                f"the checkpoint consumed {consumed_train_samples} samples but this dataset has "
                f"{self._num_samples()}; resume with the same data, or pass --ignore-data-skip"
            )
        self.consumed = consumed_train_samples
        self._finished = False

    def skip_consumed_samples(self, consumed_train_samples: int) -> None:
        """Upstream's name of ``resume_from_checkpoint``."""
        self.resume_from_checkpoint(consumed_train_samples)

    def state_dict(self) -> dict[str, int]:
        return self.get_state()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.resume_from_checkpoint(state["consumed_train_samples"])


class _Plan:
    """torch's sampler for the workers: each pass yields the steps the loader has left."""

    def __init__(self, loader: DataLoader):
        self.loader = loader

    def __iter__(self) -> Iterator[Step]:
        return self.loader._plan()
