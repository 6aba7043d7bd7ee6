"""``IterablePackingDataset``: a stream (``IterableDataset``) whose encoded samples are packed as
they are read, several per row of at most the template's ``max_length`` tokens.

The samples are packed window by window (``packing_interval`` samples at a time, best-fit
decreasing as ``PackingDataset`` packs, ``twinkle.dataset.packing``), so the stream is never held
whole. A packed row's ``position_ids`` restart at each sample, and the model's processor gives
each sample its own row of the batch (``twinkle.processor.collate``). Packing reads only the
lengths, so it runs in the reading process."""

from collections.abc import Iterator
from itertools import islice
from typing import Any

from twinkle.dataset.iterable import IterableDataset
from twinkle.dataset.meta import DatasetMeta
from twinkle.dataset.packing import join_samples, pack_lengths
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

logger = get_logger()


class IterablePackingDataset(IterableDataset):
    """Upstream's ``IterablePackingDataset(dataset_meta, packing_interval=128,
    packing_num_proc=1, cyclic=False)``: ``set_template``, ``map``, ``encode`` as for
    ``IterableDataset``, then ``pack_dataset()``; reading yields packed rows. ``cyclic=True``
    reads the stream again from its start when it ends, without end (give the run its number of
    steps). ``packing_num_proc`` other than 1 is logged: packing runs in one process."""

    def __init__(
        self,
        dataset_meta: DatasetMeta,
        packing_interval: int = 128,
        packing_num_proc: int = 1,
        cyclic: bool = False,
    ):
        if packing_interval < 1:
            raise UserError(
                f"IterablePackingDataset: packing_interval must be at least 1, got {packing_interval}"
            )
        super().__init__(dataset_meta)
        self.packing_interval = packing_interval
        self.cyclic = bool(cyclic)
        if packing_num_proc != 1:
            logger.info(
                f"IterablePackingDataset: packing_num_proc={packing_num_proc}: packing runs in one process"
            )

    def pack_dataset(self) -> "IterablePackingDataset":
        """Check that rows can be packed (reading packs them, window by window)."""
        if self.template is None:
            raise UserError("call dataset.set_template(...) before dataset.pack_dataset()")
        if not self.encoded:
            raise UserError("call dataset.encode() before dataset.pack_dataset()")
        return self

    def _samples(self) -> Iterator[dict[str, Any]]:
        while True:
            count = 0
            for index, row in IterableDataset.raw_rows(self):
                sample = IterableDataset.finish_row(self, row, index)
                if sample is None:  # dropped by encoding
                    continue
                if "positive" in sample:
                    raise UserError(
                        "preference pairs are not packed (the model runs preference losses unpacked); "
                        "use IterableDataset instead of IterablePackingDataset"
                    )
                count += 1
                yield sample
            if not self.cyclic or count == 0:
                return

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self.pack_dataset()
        samples = self._samples()
        while window := list(islice(samples, self.packing_interval)):
            lengths = [len(s["input_ids"]) for s in window]
            for row in pack_lengths(lengths, self.template.max_length, window=len(window)):
                yield join_samples([window[i] for i in row])

    def raw_rows(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """The packed rows, numbered: the ``DataLoader`` reads a stream through this, and packing
        needs the encoded samples, so they are read, encoded and packed here."""
        return enumerate(iter(self))

    def finish_row(self, row: dict[str, Any], index: int) -> dict[str, Any]:
        return row
