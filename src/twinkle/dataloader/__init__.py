"""Batches for this rank: ``DataLoader`` (resumable, distributed) and ``collate``.

Public names: ``DataLoader``, ``collate``, ``interleave_pairs`` (preference rows as
``[pos_1, neg_1, pos_2, neg_2, ...]``)."""

from twinkle.dataloader.collate import collate, interleave_pairs
from twinkle.dataloader.dataloader import DataLoader

__all__ = ["DataLoader", "collate", "interleave_pairs"]
