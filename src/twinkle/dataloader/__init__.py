"""Batches for this rank: ``DataLoader`` (resumable, distributed) and ``collate``.

Public names: ``DataLoader``, ``collate``."""

from twinkle.dataloader.collate import collate
from twinkle.dataloader.dataloader import DataLoader

__all__ = ["DataLoader", "collate"]
