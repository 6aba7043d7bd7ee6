"""``Episode``: one trajectory while it is played out: its tokens, which of them the model
generated, the sampler's log-probs of those, its messages and rewards."""

from dataclasses import dataclass, field
from typing import Any

from twinkle.template.rows import IGNORE_INDEX, feature_of


@dataclass
class Episode:
    """``ids``/``labels``: the whole trajectory so far, labels equal to the token where the
    model generated it and -100 everywhere else (prompt, tool results, template tokens)."""

    source: dict[str, Any]
    manager: Any
    messages: list[dict[str, Any]]
    ids: list[int]
    labels: list[int] = field(default_factory=list)
    logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    stop_reason: str | None = None
    truncated: bool = False
    done: bool = False

    def __post_init__(self) -> None:
        self.labels = [IGNORE_INDEX] * len(self.ids)

    def add_generated(self, tokens: list[int], logprobs: list[Any]) -> None:
        self.ids += tokens
        self.labels += tokens
        self.logprobs += [list(lp) for lp in logprobs]

    def add_context(self, tokens: list[int]) -> None:
        self.ids += tokens
        self.labels += [IGNORE_INDEX] * len(tokens)

    def finish(self, reason: str, truncated: bool = False) -> None:
        self.stop_reason, self.truncated, self.done = reason, truncated, True

    def record(self, reward: float) -> dict[str, Any]:
        """The played-out trajectory: the input's keys, its messages and a training row
        (``input_ids``, ``labels``, ...), the sampler's ``logprobs`` per generated token
        (``[(token, logprob)]``) and ``old_logps`` (the floats ``forward_backward`` takes), and
        ``reward``, ``turn_rewards``, ``turns``, ``stop_reason``, ``truncated``, ``tool_calls``,
        ``tool_errors``."""
        out = {k: v for k, v in self.source.items() if k not in ("input_ids", "labels")}
        out.update(feature_of(list(self.ids), list(self.labels)))
        out.update(
            messages=self.messages,
            logprobs=self.logprobs,
            old_logps=[lp[0][1] for lp in self.logprobs],
            reward=reward,
            turn_rewards=list(self.turn_rewards),
            turns=self.turns,
            stop_reason=self.stop_reason,
            truncated=self.truncated,
            tool_calls=self.tool_calls,
            tool_errors=self.tool_errors,
        )
        return out
