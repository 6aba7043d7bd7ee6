"""Chunkers cut a trajectory into ``Chunks`` (``twinkle_agentic.data_format``).

Public names: ``Chunker`` (the interface: ``chunker(trajectory) -> Chunks``), ``NativeChunker``
(``twinkle_agentic.chunker.native``: the first user message cut at separators into pieces of at
most ``chunk_size`` characters)."""

from twinkle_agentic.chunker.base import Chunker
from twinkle_agentic.chunker.native import NativeChunker

__all__ = ["Chunker", "NativeChunker"]
