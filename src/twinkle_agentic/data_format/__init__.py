"""Records of ``twinkle_agentic``: ``Chunk`` (one piece of a trajectory) and ``Chunks`` (a
trajectory cut into pieces, and put back together by ``to_trajectory``)."""

from twinkle_agentic.data_format.chunks import Chunk, Chunks

__all__ = ["Chunk", "Chunks"]
