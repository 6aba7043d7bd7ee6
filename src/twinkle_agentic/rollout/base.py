"""``Rollout``: trajectories in, the same trajectories played out, in order."""

from abc import ABC, abstractmethod
from typing import Any


class Rollout(ABC):
    @abstractmethod
    def __call__(self, trajectories: list[dict[str, Any]], **kwargs: Any) -> list[dict[str, Any]]:
        raise NotImplementedError
