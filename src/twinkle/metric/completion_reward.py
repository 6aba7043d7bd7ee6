"""``CompletionRewardMetric``: the rewards and lengths of sampled completions, over all ranks.

The loop feeds it (``metric.accumulate(rewards={'accuracy': [...], ...}, completion_lengths=[...])``)
and either reads ``metric.calculate()`` itself or adds it to the model
(``model.add_metric(metric, is_training=True)``) so that ``model.calculate_metric()`` reports
its numbers into ``metrics.jsonl`` and the curves with the step's."""

import math
from typing import Any

from twinkle.metric.base import Metric
from twinkle.runtime.remote import remote_class  # remote_group= hook
from twinkle.utils.errors import UserError


@remote_class  # remote_group=: one per rank of a device group (twinkle.runtime.remote)
class CompletionRewardMetric(Metric):
    """``calculate()`` (which also resets) returns, over the completions of every rank since the
    last call: ``train/<name>_reward`` (mean) and ``train/<name>_reward_std`` (population std)
    per reward name, ``train/completion_length`` (mean tokens), and, when timings were given,
    ``profiling/generate_seconds`` / ``profiling/weight_sync_seconds`` (means). ``{}`` when
    nothing was accumulated. The model's per-micro-batch ``accumulate(inputs, outputs)`` call
    adds nothing."""

    def __init__(self, device_mesh: Any = None, process_group: Any = None):
        super().__init__(device_mesh, process_group)
        self.reset()

    def reset(self) -> None:
        self.rewards: dict[str, list[float]] = {}
        self.lengths: list[int] = []
        self.timings: dict[str, list[float]] = {}

    def accumulate(
        self,
        inputs: Any = None,
        outputs: Any = None,
        *,
        rewards: dict[str, Any] | None = None,
        completion_lengths: Any = None,
        generate_time: float | None = None,
        weight_sync_time: float | None = None,
        **kwargs: Any,
    ) -> None:
        for name, values in (rewards or {}).items():
            values = [float(v) for v in values]
            if not all(math.isfinite(v) for v in values):
                raise UserError(
                    f"CompletionRewardMetric: reward {name!r} holds a NaN or inf; rewards must be finite"
                )
            self.rewards.setdefault(str(name), []).extend(values)
        self.lengths.extend(int(n) for n in completion_lengths or ())
        for key, value in (("generate", generate_time), ("weight_sync", weight_sync_time)):
            if value is not None:
                self.timings.setdefault(key, []).append(float(value))

    def calculate(self) -> dict[str, Any]:
        local = [(self.rewards, self.lengths, self.timings)]
        self.reset()
        rewards: dict[str, list[float]] = {}
        lengths: list[int] = []
        timings: dict[str, list[float]] = {}
        for part_rewards, part_lengths, part_timings in self.gather_results(local):
            for name, values in part_rewards.items():
                rewards.setdefault(name, []).extend(values)
            lengths.extend(part_lengths)
            for name, values in part_timings.items():
                timings.setdefault(name, []).extend(values)
        out: dict[str, Any] = {}
        for name, values in rewards.items():
            if values:
                mean = sum(values) / len(values)
                out[f"train/{name}_reward"] = mean
                out[f"train/{name}_reward_std"] = math.sqrt(
                    sum((v - mean) ** 2 for v in values) / len(values)
                )
        if lengths:
            out["train/completion_length"] = sum(lengths) / len(lengths)
        for name, values in timings.items():
            out[f"profiling/{name}_seconds"] = sum(values) / len(values)
        return out
