"""Datasets: ``DatasetMeta`` says what to load, ``Dataset`` loads, maps and encodes it.

Public names: ``Dataset``, ``DatasetMeta``."""

from twinkle.dataset.dataset import Dataset, DatasetMeta

__all__ = ["Dataset", "DatasetMeta"]
