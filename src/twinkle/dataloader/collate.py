"""The padding collate of encoded rows, here for the loader's users: it lives with the
processor that runs it (``twinkle.processor.collate``)."""

from twinkle.processor.collate import collate, interleave_pairs, is_pair, segment_starts, split_packed

__all__ = ["collate", "interleave_pairs", "is_pair", "segment_starts", "split_packed"]
