"""``Reward``: ``reward(trajectories) -> list[float]``, one per trajectory, and the two reads every
reward needs: the completion (the last assistant message) and the ground truth."""

from collections.abc import Mapping, Sequence
from typing import Any


class Reward:
    """Base of the rewards: subclasses implement ``score(completion, trajectory) -> float``, or
    override ``__call__`` to score a whole batch at once. ``name`` labels the reward in metrics
    (``train/<name>_reward``)."""

    name = "reward"

    def __call__(self, trajectories: Sequence[Mapping[str, Any]], **kwargs: Any) -> list[float]:
        return [float(self.score(completion_of(t), t)) for t in trajectories]

    def score(self, completion: str, trajectory: Mapping[str, Any]) -> float:
        raise NotImplementedError(f"{type(self).__name__} must implement score(completion, trajectory)")


def completion_of(trajectory: Mapping[str, Any]) -> str:
    """The text of the trajectory's last assistant message ('' when there is none)."""
    for message in reversed(trajectory.get("messages") or []):
        if message.get("role") == "assistant":
            content = message.get("content")
            return content if isinstance(content, str) else ""
    return ""


def ground_truth_of(trajectory: Mapping[str, Any], key: str = "ground_truth") -> Any:
    """``key`` from the trajectory's ``user_data`` (upstream's list of ``(key, value)`` pairs, or a
    mapping), else the trajectory's own ``key``; None when neither has it."""
    user_data = trajectory.get("user_data")
    if isinstance(user_data, Mapping):
        if key in user_data:
            return user_data[key]
    elif user_data:
        for item in user_data:
            if len(item) == 2 and item[0] == key:
                return item[1]
    return trajectory.get(key)
