"""``Chunk`` and ``Chunks``: a trajectory as a list of pieces that a condenser may shorten one by
one, and the way back to messages."""

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import groupby
from typing import Any, Literal, TypedDict


class Chunk(TypedDict, total=False):
    """One piece: ``type`` (``'text'``), ``content`` (its text), ``role`` of the message it came
    from, ``round`` (1 from the first user message on; 0 before it), and ``raw``: the whole
    message for a piece that is a whole message, else ``{'kind': 'piece', 'condensed': bool}``."""

    type: Literal["text", "image", "video", "audio"]
    content: Any
    raw: Any
    role: str
    round: int


def _is_piece(chunk: Mapping[str, Any]) -> bool:
    raw = chunk.get("raw")
    return isinstance(raw, Mapping) and raw.get("kind") == "piece"


@dataclass
class Chunks:
    """The pieces of one trajectory, in order."""

    chunks: list[Chunk]

    def to_trajectory(
        self, block_wrapper: tuple[str, str] | None = ("<block_{n}>", "</block_{n}>")
    ) -> dict[str, Any]:
        """The trajectory again: a whole-message piece is its message (its content taken from the
        piece, which a condenser may have changed), and a run of text pieces of one message is
        one message of their joined text. With ``block_wrapper``, each piece marked
        ``condensed`` is wrapped in the pair, ``{n}`` numbering the wrapped pieces from 1."""
        wrapped = 0
        messages: list[dict[str, Any]] = []
        for whole, run in groupby(self.chunks, key=lambda c: not _is_piece(c)):
            if whole:
                for chunk in run:
                    raw = chunk.get("raw")
                    message = dict(raw) if isinstance(raw, Mapping) else {"role": chunk.get("role", "user")}
                    message["content"] = chunk.get("content")
                    messages.append(message)
                continue
            for (role, _round), same in groupby(run, key=lambda c: (c.get("role", "user"), c.get("round"))):
                texts = []
                for chunk in same:
                    text = str(chunk.get("content") or "")
                    if block_wrapper and chunk["raw"].get("condensed") and text:
                        wrapped += 1
                        text = block_wrapper[0].format(n=wrapped) + text + block_wrapper[1].format(n=wrapped)
                    texts.append(text)
                messages.append({"role": role, "content": "".join(texts)})
        return {"messages": messages}
