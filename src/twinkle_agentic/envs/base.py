"""``Env`` (an environment the model acts in through tool calls) and ``StepResult``."""

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepResult:
    """What a reset or a step returns: the ``observation`` the model reads next, the step's
    ``reward``, whether the episode is ``done``, and anything else in ``info``."""

    observation: str = ""
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Environment(ABC):
    """The protocol every environment follows (upstream's ``Env``):

    - ``reset(trajectory=None, seed=None)``: start an episode; ``seed`` makes it reproducible
      (``EnvPool`` passes one per slot and episode, so a pool gives the same episodes wherever
      its environments run);
    - ``step(tool_name, arguments)``: one action, named as a tool call names it;
    - ``tools()``: the actions as tool descriptions (OpenAI function shape); ``EnvTool.from_env``
      turns each into a tool;
    - ``close()``."""

    def reset(self, trajectory: Any = None, seed: int | None = None) -> StepResult:
        return StepResult()

    @abstractmethod
    def step(self, tool_name: str, arguments: dict[str, Any]) -> StepResult:
        raise NotImplementedError

    def tools(self) -> list[dict[str, Any]]:
        return []

    def close(self) -> None:  # noqa: B027 (optional: most environments hold nothing to release)
        return None

    def __enter__(self) -> "Environment":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


Env = Environment  # upstream's name
