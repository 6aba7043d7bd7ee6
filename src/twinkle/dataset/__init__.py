"""Datasets: ``DatasetMeta`` says what to load, ``Dataset`` loads, maps and encodes it;
``LazyDataset`` maps and encodes each row when it is read; ``IterableDataset`` streams rows
larger than memory; ``PackingDataset`` and ``IterablePackingDataset`` put several encoded
samples in a row.

Public names: ``Dataset``, ``DatasetMeta``, ``LazyDataset``, ``IterableDataset``,
``PackingDataset``, ``IterablePackingDataset``."""

from twinkle.dataset.dataset import Dataset, DatasetMeta
from twinkle.dataset.iterable import IterableDataset
from twinkle.dataset.iterable_packing import IterablePackingDataset
from twinkle.dataset.lazy import LazyDataset
from twinkle.dataset.packing import PackingDataset

__all__ = [
    "Dataset",
    "DatasetMeta",
    "LazyDataset",
    "IterableDataset",
    "PackingDataset",
    "IterablePackingDataset",
]
