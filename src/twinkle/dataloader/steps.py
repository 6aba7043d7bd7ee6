"""What each step of a pass reads: the global batch, and the share of it this rank reads.

Every rank plans the same global batches from the same order, so ranks need no communication
to agree; each keeps the contiguous slice at its data rank. A step is planned in the loader's
own process and carried out (rows fetched, encoded, collated) there or in a worker process."""

import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any


@dataclass(frozen=True)
class Step:
    """``share``: what this rank reads (dataset indices, or ``(index, row)`` pairs of a stream);
    ``size``: samples in the global batch, all ranks together (what the step consumes)."""

    share: list[Any]
    size: int


def rank_share(batch: Sequence[Any], rank: int, world_size: int) -> list[Any]:
    """Rank ``rank``'s contiguous part; the first ``len(batch) % world_size`` parts are one longer."""
    base, extra = divmod(len(batch), world_size)
    start = rank * base + min(rank, extra)
    return list(batch[start : start + base + (rank < extra)])


def index_steps(
    order: Sequence[int], start: int, end: int, batch_size: int, rank: int, world_size: int
) -> Iterator[Step]:
    """Global batches of ``order[start:end]`` (the caller has cut ``end`` to whole batches,
    a short last one included or not)."""
    for first in range(start, end, batch_size):
        batch = order[first : min(first + batch_size, end)]
        yield Step(rank_share(batch, rank, world_size), len(batch))


def stream_steps(
    rows: Iterable[Any],
    skip: int,
    batch_size: int,
    min_batch_size: int,
    rank: int,
    world_size: int,
) -> Iterator[Step]:
    """Global batches of a stream after its first ``skip`` items; a last batch shorter than
    ``min_batch_size`` is not read (``drop_last`` asks for ``min_batch_size == batch_size``)."""
    rows = iter(rows)
    for _ in islice(rows, skip):  # read and discard: a stream has no index to jump to
        pass
    while True:
        batch = list(islice(rows, batch_size))
        if not batch or len(batch) < min_batch_size:
            return
        yield Step(rank_share(batch, rank, world_size), len(batch))


def buffer_shuffle(rows: Iterable[Any], buffer_size: int, seed: int) -> Iterator[Any]:
    """A stream in a random order drawn from ``seed``: each item read goes to a random place
    of a buffer of ``buffer_size`` items, and the item it replaces comes out. The same stream
    and seed give the same order, on every rank and in every pass."""
    rng = random.Random(seed)
    buffer: list[Any] = []
    for row in rows:
        if len(buffer) < buffer_size:
            buffer.append(row)
            continue
        slot = rng.randrange(buffer_size)
        yield buffer[slot]
        buffer[slot] = row
    rng.shuffle(buffer)
    yield from buffer
