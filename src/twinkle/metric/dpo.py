"""``DPOMetric``: log-probabilities and implicit rewards of preference pairs, over all ranks.

Add it with ``model.add_metric(DPOMetric, beta=0.1)`` (the loss's ``beta``); its numbers join
``calculate_metric``'s and reach ``metrics.jsonl`` with them."""

from typing import Any

import torch

from twinkle.metric.base import Metric

IGNORE_INDEX = -100
SUMS = ("chosen_logps", "rejected_logps", "chosen_reward", "rejected_reward", "reward_margin")


class DPOMetric(Metric):
    """Per micro-batch of interleaved pairs (rows ``2i``, ``2i + 1``: chosen, rejected) the model
    hands ``inputs["labels"]`` (shifted, -100 where none), ``outputs["logps"]`` (``(B, L)`` at
    the same positions; the preference losses compute them) and, when the step had a reference,
    ``outputs["ref_logps"]`` (or ``ref_outputs={"logps": ...}`` in the context, upstream's way),
    aligned the same. Each row's log-probability is the sum over its labels.

    ``calculate`` returns means over the pairs of every rank: ``chosen_logps``,
    ``rejected_logps``, and with a reference ``chosen_reward`` / ``rejected_reward``
    (``beta * (logp - ref)``), ``reward_margin`` (their difference) and ``reward_accuracy``
    (the share of pairs whose margin is above 0); ``pairs``; ``{}`` when no pair was seen.
    A micro-batch without ``logps`` (a loss that is not a preference loss) is not counted."""

    def __init__(self, device_mesh: Any = None, process_group: Any = None, beta: float = 0.1):
        super().__init__(device_mesh, process_group)
        self.beta = float(beta)
        self.reset()

    def reset(self) -> None:
        self.sums = dict.fromkeys(SUMS, 0.0)
        self.correct = 0
        self.pairs = 0
        self.rewarded = 0  # pairs that had a reference

    def accumulate(self, inputs: Any, outputs: Any, **kwargs: Any) -> None:
        logps = outputs.get("logps")
        if logps is None:
            return
        labels = torch.as_tensor(inputs["labels"]).to(logps.device)
        mask = labels != IGNORE_INDEX
        seq = torch.where(mask, logps.double(), 0.0).sum(-1)
        if seq.numel() < 2:  # a rank's empty share
            return
        chosen, rejected = seq[0::2], seq[1::2]
        self.sums["chosen_logps"] += float(chosen.sum())
        self.sums["rejected_logps"] += float(rejected.sum())
        self.pairs += chosen.numel()
        ref = outputs.get("ref_logps")
        if ref is None:
            ref = (kwargs.get("ref_outputs") or {}).get("logps")
        if ref is None:
            return
        ref_seq = torch.where(mask, ref.to(logps.device).double(), 0.0).sum(-1)
        chosen_reward = self.beta * (chosen - ref_seq[0::2])
        rejected_reward = self.beta * (rejected - ref_seq[1::2])
        margin = chosen_reward - rejected_reward
        self.sums["chosen_reward"] += float(chosen_reward.sum())
        self.sums["rejected_reward"] += float(rejected_reward.sum())
        self.sums["reward_margin"] += float(margin.sum())
        self.correct += int((margin > 0).sum())
        self.rewarded += chosen.numel()

    def calculate(self) -> dict[str, Any]:
        local = [(*self.sums.values(), self.correct, self.pairs, self.rewarded)]
        totals = [sum(column) for column in zip(*self.gather_results(local), strict=True)]
        self.reset()
        sums, (correct, pairs, rewarded) = dict(zip(SUMS, totals[:5], strict=True)), totals[5:]
        if not pairs:
            return {}
        out = {"chosen_logps": sums["chosen_logps"] / pairs, "rejected_logps": sums["rejected_logps"] / pairs}
        if rewarded:
            for name in ("chosen_reward", "rejected_reward", "reward_margin"):
                out[name] = sums[name] / rewarded
            out["reward_accuracy"] = correct / rewarded
        out["pairs"] = int(pairs)
        return out
