"""Upstream's module path of ``Dataset`` and ``DatasetMeta`` (``from twinkle.dataset.base import
DatasetMeta``); both live in ``twinkle.dataset.dataset``."""

from twinkle.dataset.dataset import Dataset, DatasetMeta

__all__ = ["Dataset", "DatasetMeta"]
