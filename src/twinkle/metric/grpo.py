"""``GRPOMetric`` (and ``GSPOMetric``, ``CISPOMetric``): how far the policy moved from the
sampler's, over the completion tokens of every rank.

The loop feeds it each micro-batch it trained on, with the values it gave the loss:

    metric = GRPOMetric()
    out = model.forward_backward(inputs=rows, old_logps=old, advantages=adv)
    metric.accumulate(rows, out, old_logps=old, advantages=adv)
    log = metric.calculate()

``inputs`` is a row or a list of rows (``labels``, -100 where no target is); ``outputs["logps"]``
the policy's per-label log-probabilities aligned with those labels (a ``(B, L)`` tensor, or a list
of them, one per micro-batch, with ``inputs`` one list per micro-batch too); ``old_logps`` one
entry per sequence in order over all micro-batches (the sampler's completion log-probs), or a
tensor shaped as ``logps``; ``advantages`` one number per sequence."""

import math
from typing import Any

import torch

from twinkle.metric.base import Metric
from twinkle.utils.errors import UserError
from twinkle.utils.transformers_utils import align_logps_to_mask

SUMS = ("n", "new", "old", "diff", "kl", "entropy", "n_entropy", "clip_low", "clip_high", "clip_n")
MAXES = ("kl_max", "ratio_max")


class GRPOMetric(Metric):
    """``calculate()`` (which also resets) returns token means over every rank:
    ``train/mean_new_logp`` and ``train/policy_confidence`` (its ``exp``); with ``old_logps``,
    ``train/mean_old_logp``, ``train/logp_diff_mean`` (new - old), ``train/approx_kl`` (Schulman's
    k3 estimate of KL(old || new): ``exp(d) - d - 1`` with ``d`` = new - old), and the largest
    token KL and ratio (``train/token_kl_max``, ``train/token_ratio_max``); with ``advantages``,
    ``train/clip_ratio_low`` / ``_high`` / ``train/clip_ratio``: the share of tokens the loss's clip
    at ``[1 - epsilon, 1 + epsilon_high]`` stopped (low: ratio below with a negative advantage;
    high: above with a positive one); with ``outputs["entropies"]``, ``train/entropy``. ``{}``
    when no token was seen. ``temperature``: the sampler's, when its log-probs were of the
    tempered distribution; both sides are multiplied by it to read as at temperature 1."""

    def __init__(
        self,
        device_mesh: Any = None,
        process_group: Any = None,
        ignore_index: int = -100,
        temperature: float = 1.0,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        top_k_kl: int = 0,
    ):
        super().__init__(device_mesh, process_group)
        if top_k_kl:
            raise UserError(
                f"{type(self).__name__}: not supported yet: top_k_kl={top_k_kl!r} (per-token KL records)"
            )
        if not (isinstance(temperature, int | float) and temperature > 0):
            raise UserError(
                f"{type(self).__name__}: temperature must be a number above 0, got {temperature!r}"
            )
        self.ignore_index = int(ignore_index)
        self.temperature = float(temperature)
        self.epsilon = float(epsilon)
        self.epsilon_high = float(epsilon if epsilon_high is None else epsilon_high)
        self.top_k_kl = 0
        self.reset()

    def reset(self) -> None:
        self.sums = dict.fromkeys(SUMS, 0.0)
        self.maxes = dict.fromkeys(MAXES, 0.0)
        self.has_old = False

    def accumulate(
        self, inputs: Any, outputs: Any, *, old_logps: Any = None, advantages: Any = None, **context: Any
    ) -> None:
        """One step's micro-batches (see the module docstring). ``context`` is what the model
        passes every metric (``lr``, ``step``, ...): not read here."""
        logps = None if outputs is None else outputs.get("logps")  # a dict, or a step's StepOutputs
        if logps is None:
            return
        batches = inputs if isinstance(inputs, list) and isinstance(logps, list) else [inputs]
        logps = logps if isinstance(logps, list) else [logps]
        entropies = outputs.get("entropies")
        entropies = entropies if isinstance(entropies, list) or entropies is None else [entropies]
        if len(batches) != len(logps):
            raise UserError(
                f"{len(batches)} micro-batches of inputs but {len(logps)} of logps; give one per micro-batch"
            )
        cursor = 0
        for index, (batch, mb_logps) in enumerate(zip(batches, logps, strict=True)):
            labels = _labels(batch, mb_logps, self.ignore_index)
            rows = labels.shape[0]
            old = _slice(old_logps, cursor, rows, mb_logps)
            adv = _slice(advantages, cursor, rows, mb_logps)
            ent = entropies[index] if entropies is not None else None
            self._micro_batch(labels != self.ignore_index, mb_logps.detach(), old, adv, ent)
            cursor += rows

    def _micro_batch(self, mask: torch.Tensor, logps: torch.Tensor, old: Any, adv: Any, ent: Any) -> None:
        if not mask.any():
            return
        new = logps.double() * self.temperature
        m = mask.to(new.dtype)
        self.sums["n"] += float(m.sum())
        self.sums["new"] += float((new * m).sum())
        if ent is not None:
            self.sums["entropy"] += float((ent.detach().double() * m).sum())
            self.sums["n_entropy"] += float(m.sum())
        if old is None:
            return
        old = align_logps_to_mask(old, mask, torch.float64) * self.temperature
        d = (new - old) * m
        kl = (torch.exp(d) - d - 1) * m
        self.has_old = True
        self.sums["old"] += float((old * m).sum())
        self.sums["diff"] += float(d.sum())
        self.sums["kl"] += float(kl.sum())
        self.maxes["kl_max"] = max(self.maxes["kl_max"], float(kl.max()))
        self.maxes["ratio_max"] = max(self.maxes["ratio_max"], float((torch.exp(d) * m).max()))
        if adv is not None:
            low, high, count = self.clipped(d, align_logps_to_mask(adv, mask, torch.float64), m)
            self.sums["clip_low"] += low
            self.sums["clip_high"] += high
            self.sums["clip_n"] += count

    def clipped(
        self, log_ratio: torch.Tensor, adv: torch.Tensor, m: torch.Tensor
    ) -> tuple[float, float, float]:
        """(tokens clipped below, above, tokens counted): GRPO clips each token's ratio."""
        ratio = torch.exp(log_ratio)
        low = (ratio < 1 - self.epsilon) & (adv < 0)
        high = (ratio > 1 + self.epsilon_high) & (adv > 0)
        return float((low * m).sum()), float((high * m).sum()), float(m.sum())

    def calculate(self) -> dict[str, Any]:
        local = [(list(self.sums.values()), list(self.maxes.values()), self.has_old)]
        self.reset()
        parts = self.gather_results(local)
        sums = dict(zip(SUMS, [sum(col) for col in zip(*(p[0] for p in parts), strict=True)], strict=True))
        maxes = dict(zip(MAXES, [max(col) for col in zip(*(p[1] for p in parts), strict=True)], strict=True))
        n = sums["n"]
        if not n:
            return {}
        out = {"train/policy_confidence": math.exp(sums["new"] / n), "train/mean_new_logp": sums["new"] / n}
        if any(p[2] for p in parts):
            out["train/mean_old_logp"] = sums["old"] / n
            out["train/logp_diff_mean"] = sums["diff"] / n
            out["train/approx_kl"] = sums["kl"] / n
            out["train/token_kl_max"] = maxes["kl_max"]
            out["train/token_ratio_max"] = maxes["ratio_max"]
        if sums["n_entropy"]:
            out["train/entropy"] = sums["entropy"] / sums["n_entropy"]
        if sums["clip_n"]:
            out["train/clip_ratio_low"] = sums["clip_low"] / sums["clip_n"]
            out["train/clip_ratio_high"] = sums["clip_high"] / sums["clip_n"]
            out["train/clip_ratio"] = (sums["clip_low"] + sums["clip_high"]) / sums["clip_n"]
        return out


class GSPOMetric(GRPOMetric):
    """GSPO clips one ratio per completion (``exp`` of its mean token log-ratio): the clip ratios
    count completions."""

    def clipped(self, log_ratio, adv, m):
        tokens = m.sum(-1)
        kept = tokens > 0
        ratio = torch.exp(log_ratio.sum(-1)[kept] / tokens[kept])
        seq_adv = (adv * m).sum(-1)[kept] / tokens[kept]
        low = (ratio < 1 - self.epsilon) & (seq_adv < 0)
        high = (ratio > 1 + self.epsilon_high) & (seq_adv > 0)
        return float(low.sum()), float(high.sum()), float(kept.sum())


class CISPOMetric(GRPOMetric):
    """CISPO clips the weight whatever the advantage's sign: the clip ratios count every token
    whose ratio left ``[1 - epsilon, 1 + epsilon_high]``."""

    def clipped(self, log_ratio, adv, m):
        ratio = torch.exp(log_ratio)
        low, high = ratio < 1 - self.epsilon, ratio > 1 + self.epsilon_high
        return float((low * m).sum()), float((high * m).sum()), float(m.sum())


def _labels(batch: Any, logps: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """The micro-batch's labels as ``(B, L)`` beside ``logps``: rows of a list stacked, shorter
    ones padded with ``ignore_index``; a shape other than ``logps``'s is a one-line error."""
    rows = batch if isinstance(batch, list) else [batch]
    try:
        labels = [torch.as_tensor(row["labels"]) for row in rows]
    except (KeyError, TypeError) as exc:
        raise UserError("GRPOMetric: each input needs 'labels'") from exc
    labels = [t.reshape(-1, t.shape[-1]) for t in labels]
    width = max(t.shape[-1] for t in labels)
    padded = [torch.nn.functional.pad(t, (0, width - t.shape[-1]), value=ignore_index) for t in labels]
    out = torch.cat(padded).to(logps.device)
    if out.shape != logps.shape:
        raise UserError(
            f"GRPOMetric: labels {tuple(out.shape)} and logps {tuple(logps.shape)} differ; give the "
            "log-probs aligned with the labels"
        )
    return out


def _slice(values: Any, start: int, rows: int, logps: torch.Tensor) -> Any:
    """This micro-batch's share of per-sequence ``values`` (a tensor shaped as ``logps``
    is taken as it is)."""
    if values is None or (torch.is_tensor(values) and values.shape == logps.shape):
        return values
    return list(values)[start : start + rows]
