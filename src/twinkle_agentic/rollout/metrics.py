"""``RolloutMetrics``: what one rollout call did, as numbers (counts and seconds)."""

from dataclasses import asdict, dataclass, field

from twinkle_agentic.tools.base import ERROR_KINDS


@dataclass
class RolloutMetrics:
    """Counts over a call's trajectories and where its time went.

    ``errors``: error observations by kind (``twinkle_agentic.tools.base.ERROR_KINDS``);
    ``turn_limit``/``token_limit``/``length_cut``: trajectories ended by ``max_turns``, by
    ``max_trajectory_tokens``, or by a reply cut at the sampler's ``max_tokens``;
    ``sample_seconds``/``env_seconds``: time in the sampler and in tools and environments."""

    trajectories: int = 0
    turns: int = 0
    generated_tokens: int = 0
    observation_tokens: int = 0
    tool_calls: int = 0
    errors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ERROR_KINDS, 0))
    turn_limit: int = 0
    token_limit: int = 0
    length_cut: int = 0
    sample_seconds: float = 0.0
    env_seconds: float = 0.0
    total_seconds: float = 0.0

    def as_dict(self, prefix: str = "rollout/") -> dict[str, float]:
        """Flat numbers for a metrics log (``errors`` as ``rollout/error_<kind>``), with the
        rates: turns and generated tokens per second, and the share of time spent in tools."""
        flat = {k: v for k, v in asdict(self).items() if k != "errors"}
        flat.update({f"error_{k}": v for k, v in self.errors.items()})
        total = self.total_seconds or float("nan")
        flat.update(
            turns_per_second=self.turns / total,
            generated_tokens_per_second=self.generated_tokens / total,
            env_share=self.env_seconds / total,
        )
        return {prefix + k: float(v) for k, v in flat.items()}
