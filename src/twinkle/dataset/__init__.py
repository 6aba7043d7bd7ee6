"""Datasets: ``DatasetMeta`` says what to load, ``Dataset`` loads, maps and encodes it;
``IterableDataset`` streams rows larger than memory; ``PackingDataset`` puts several encoded
samples in a row.

Public names: ``Dataset``, ``DatasetMeta``, ``IterableDataset``, ``PackingDataset``."""

from twinkle.dataset.dataset import Dataset, DatasetMeta
from twinkle.dataset.iterable import IterableDataset
from twinkle.dataset.packing import PackingDataset

__all__ = ["Dataset", "DatasetMeta", "IterableDataset", "PackingDataset"]
