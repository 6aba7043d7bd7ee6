"""``PackingDataset``: several encoded samples per row, each row at most ``max_length`` tokens.

Rows of about the same length make steps of about the same cost and leave no padding. A
packed row lays its samples end to end; ``position_ids`` start again at 0 at each sample
(that is how a row says where its samples begin), and the label of each sample's first token
is ``-100``, so the token before it, the previous sample's last, predicts nothing across the
border. ``twinkle.dataloader.collate`` gives each sample of a packed row its own row of the
batch, so attention never crosses from one sample into another.

Which samples share a row: best-fit decreasing over windows of ``PACKING_WINDOW`` samples in
data order (each sample, longest first, goes into the fullest row it still fits; the emptiest
row of a window waits for the next window's samples). The result depends only on the lengths,
so every rank and every run packs alike."""

from bisect import bisect_left, insort
from collections.abc import Sequence
from typing import Any

from twinkle.dataset.dataset import Dataset, DatasetMeta
from twinkle.dataset.pairs import holds_pairs
from twinkle.template.base import IGNORE_INDEX
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

logger = get_logger()
PACKING_WINDOW = 1000
_TOKEN_COLUMNS = ("input_ids", "labels", "attention_mask")


def _best_fit(items: list[int], lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: ``items`` (sample indices) into rows of at most ``capacity`` tokens
    (a longer sample gets a row of its own)."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (tokens left, row number), ascending
    for item in sorted(items, key=lambda i: (-lengths[i], i)):
        n = lengths[item]
        at = bisect_left(free, (n, -1))
        if at == len(free):
            rows.append([item])
            if capacity - n > 0:
                insort(free, (capacity - n, len(rows) - 1))
            continue
        left, row = free.pop(at)
        rows[row].append(item)
        if left - n > 0:
            insort(free, (left - n, row))
    return [sorted(row) for row in rows]


def pack_lengths(lengths: Sequence[int], capacity: int, window: int = PACKING_WINDOW) -> list[list[int]]:
    """Group sample indices into rows of at most ``capacity`` tokens; rows come in the order
    of their first sample."""
    rows: list[list[int]] = []
    waiting: list[int] = []
    for start in range(0, len(lengths), window):
        items = waiting + list(range(start, min(start + window, len(lengths))))
        packed = _best_fit(items, lengths, capacity)
        last_window = start + window >= len(lengths)
        if not last_window and len(packed) > 1:
            emptiest = min(range(len(packed)), key=lambda r: (sum(lengths[i] for i in packed[r]), r))
            waiting = packed.pop(emptiest)
        else:
            waiting = []
        rows += packed
    return sorted(rows, key=lambda row: row[0])


def join_samples(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Encoded samples -> one packed row (token columns end to end, positions per sample)."""
    row: dict[str, Any] = {}
    for key in samples[0]:
        values = [s[key] for s in samples]
        if key == "labels":
            row[key] = [t for v in values for t in [IGNORE_INDEX, *list(v)[1:]]]
        elif key == "position_ids":
            row[key] = [p for s in samples for p in range(len(s["input_ids"]))]
        elif key == "length":
            row[key] = sum(len(s["input_ids"]) for s in samples)
        elif key in _TOKEN_COLUMNS or (
            isinstance(values[0], list) and values[0] and not isinstance(values[0][0], list | dict)
        ):
            row[key] = [t for v in values for t in v]
        else:
            row[key] = values
    if "position_ids" not in row:
        row["position_ids"] = [p for s in samples for p in range(len(s["input_ids"]))]
    return row


class PackingDataset(Dataset):
    """A ``Dataset`` whose rows are packs of its encoded samples (see the module docstring).

    Load, ``map``, ``set_template`` and ``encode`` as with ``Dataset``; ``pack_dataset()`` then
    groups the samples into rows of at most the template's ``max_length`` tokens. Reading an
    encoded dataset that is not packed yet (``len``, indexing, a ``DataLoader``) packs it
    first, and so does reading it after its rows changed. Before ``encode()`` it reads as the
    plain ``Dataset``. ``packing_num_proc`` is accepted for upstream's signature; packing runs
    in this process (it reads only the lengths)."""

    def __init__(self, dataset_meta: DatasetMeta | None = None, packing_num_proc: int = 1):
        self.packed_idx: list[list[int]] = []
        self._packed_for: Any = None  # the ``data`` that ``packed_idx`` indexes
        super().__init__(dataset_meta)
        if packing_num_proc != 1:
            logger.warning(f"packing_num_proc={packing_num_proc} is ignored: packing runs in one process")

    def _is_encoded(self) -> bool:
        return "input_ids" in self.data.column_names

    def pack_dataset(self) -> "PackingDataset":
        """Group the encoded samples into packed rows."""
        if self.template is None:
            raise UserError("call dataset.set_template(...) before dataset.pack_dataset()")
        if holds_pairs(self.data.column_names):
            raise UserError(
                "preference pairs are not packed (the model runs preference losses unpacked); "
                "use Dataset instead of PackingDataset"
            )
        if not self._is_encoded():
            raise UserError("call dataset.encode() before dataset.pack_dataset()")
        if "length" in self.data.column_names:
            lengths = list(self.data["length"])
        else:
            lengths = [len(ids) for ids in self.data["input_ids"]]
        capacity = self.template.max_length
        self.packed_idx = pack_lengths(lengths, capacity)
        self._packed_for = self.data
        logger.info(
            f"packed {len(lengths)} samples into {len(self.packed_idx)} rows of at most {capacity} tokens "
            f"({sum(lengths) / max(1, len(self.packed_idx) * capacity):.0%} full)"
        )
        return self

    def _packed(self) -> bool:
        if self._packed_for is self.data:
            return True
        if self.template is None or not self._is_encoded():
            return False
        self.pack_dataset()
        return True

    def __len__(self) -> int:
        return len(self.packed_idx) if self._packed() else super().__len__()

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not self._packed():
            return super().__getitem__(index)
        return join_samples([super(PackingDataset, self).__getitem__(i) for i in self.packed_idx[index]])
