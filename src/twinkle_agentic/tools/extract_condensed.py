"""Upstream's module path of ``ExtractCondensed``: it imports, and refuses in one line when built
(not supported yet)."""

from twinkle_agentic.unsupported import not_supported_yet

ExtractCondensed = not_supported_yet(
    "ExtractCondensed",
    "a tool that gives back the full text of a condensed chunk (upstream's condenser experiment)",
    __name__,
)

__all__ = ["ExtractCondensed"]
