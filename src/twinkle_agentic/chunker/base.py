"""``Chunker``: ``chunker(trajectory) -> Chunks``."""

from collections.abc import Mapping
from typing import Any

from twinkle_agentic.data_format import Chunks


class Chunker:
    """Cuts a trajectory into pieces; ``Chunks.to_trajectory()`` puts them back together."""

    def __call__(self, trajectory: Mapping[str, Any]) -> Chunks:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(trajectory)")
