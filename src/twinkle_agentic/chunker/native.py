"""``NativeChunker``: cuts the first user message of a trajectory (where a question's context
documents are) into pieces of at most ``chunk_size`` characters; every other message is one
whole piece.

The text is cut at the first of ``separators`` that it holds (paragraphs, then lines, sentences,
words, and last single characters); a part still too long is cut at the next separator. The
parts are then joined back greedily while they fit in ``chunk_size``. A separator stays at the
end of the part before it, so the pieces joined are the text again. ``passage_boundary_re``
marks passages (HotpotQA's ``<block_N>``, say): the text is first cut at each match (the match
opening the next passage), and no piece spans two passages."""

import re
from collections.abc import Mapping, Sequence
from typing import Any

from twinkle.utils.errors import UserError
from twinkle_agentic.chunker.base import Chunker
from twinkle_agentic.data_format import Chunk, Chunks
from twinkle_agentic.preprocessor.text import content_text

SEPARATORS = ("\n\n", "\n", "。", ". ", "! ", "? ", "; ", ", ", " ", "")


class NativeChunker(Chunker):
    """``NativeChunker(chunk_size=1024, separators=None, passage_boundary_re=None)``."""

    def __init__(
        self,
        chunk_size: int = 1024,
        separators: Sequence[str] | None = None,
        passage_boundary_re: str | None = None,
    ) -> None:
        if chunk_size <= 0:
            raise UserError(f"NativeChunker(chunk_size=...): must be positive, got {chunk_size}")
        self.chunk_size = chunk_size
        self.separators = tuple(SEPARATORS if separators is None else separators)
        if "" not in self.separators:  # the character cut always ends the search
            self.separators += ("",)
        self.boundary = re.compile(passage_boundary_re, re.MULTILINE) if passage_boundary_re else None

    def __call__(self, trajectory: Mapping[str, Any]) -> Chunks:
        chunks: list[Chunk] = []
        rounds, cut = 0, False
        for message in trajectory.get("messages") or []:
            role = message.get("role", "user")
            rounds += role == "user"
            content = message.get("content")
            if role == "user" and not cut and isinstance(content, str):
                cut = True
                for piece in self.split(content):
                    chunks.append(
                        Chunk(
                            type="text",
                            content=piece,
                            role=role,
                            round=rounds,
                            raw={"kind": "piece", "condensed": False},
                        )
                    )
                continue
            cut = cut or role == "user"
            chunks.append(Chunk(type="text", content=content_text(content) if content is not None else None,
                                role=role, round=rounds, raw=dict(message)))  # fmt: skip
        return Chunks(chunks=chunks)

    def split(self, text: str) -> list[str]:
        """``text`` in pieces of at most ``chunk_size`` characters; ``''.join`` gives it back."""
        passages = _split_before(text, self.boundary) if self.boundary else [text]
        pieces: list[str] = []
        for passage in passages:
            if len(passage) <= self.chunk_size:
                pieces.append(passage)
            else:
                pieces.extend(self._merge(self._recursive(passage, 0)))
        return [p for p in pieces if p]

    def _recursive(self, text: str, level: int) -> list[str]:
        if len(text) <= self.chunk_size:
            return [text]
        for index in range(level, len(self.separators)):
            separator = self.separators[index]
            if separator == "":
                return [text[i : i + self.chunk_size] for i in range(0, len(text), self.chunk_size)]
            if separator in text:
                parts = _split_after(text, separator)
                return [p for part in parts for p in self._recursive(part, index + 1)]
        return [text]  # unreachable: '' is always the last separator

    def _merge(self, parts: list[str]) -> list[str]:
        merged: list[str] = []
        for part in parts:
            if merged and len(merged[-1]) + len(part) <= self.chunk_size:
                merged[-1] += part
            else:
                merged.append(part)
        return merged


def _split_after(text: str, separator: str) -> list[str]:
    """``text.split(separator)`` with each separator kept at the end of the part before it."""
    parts = text.split(separator)
    return [part + separator for part in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def _split_before(text: str, boundary: re.Pattern) -> list[str]:
    """``text`` cut before every match of ``boundary``."""
    starts = [0] + [m.start() for m in boundary.finditer(text) if m.start() > 0] + [len(text)]
    return [text[a:b] for a, b in zip(starts, starts[1:], strict=False) if b > a]
