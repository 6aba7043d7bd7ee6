"""Condensers shorten the pieces of a chunked trajectory (``twinkle_agentic.chunker``).

Public names: ``ModelCondenser``, ``KeywordCondenser``: they import, and refuse in one line when
built (not supported yet)."""

from twinkle_agentic.unsupported import not_supported_yet

_WHAT = (
    "shortening a trajectory's chunks with a model (upstream's condenser experiment); "
    "NativeChunker and Chunks.to_trajectory are available"
)
ModelCondenser = not_supported_yet("ModelCondenser", _WHAT, __name__)
KeywordCondenser = not_supported_yet("KeywordCondenser", _WHAT, __name__)

__all__ = ["ModelCondenser", "KeywordCondenser"]
