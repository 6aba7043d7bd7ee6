"""``Accuracy``: the share of supervised tokens the model predicts, over all ranks."""

from typing import Any

import torch

from twinkle.metric.base import Metric

IGNORE_INDEX = -100


class Accuracy(Metric):
    """Counts from the model's ``outputs["num_correct"]``/``["num_tokens"]`` (a token is correct
    when its target has the largest logit, a tie at the top included), or, given
    ``outputs["logits"]`` instead, ``argmax(logits) == labels`` where ``labels`` is not -100
    (or where ``inputs["completion_mask"]`` is set): ``labels[..., i]`` is the target of
    ``logits[..., i, :]``. ``calculate`` returns ``accuracy``, ``correct_tokens`` and
    ``total_tokens`` as numbers, or ``{}`` when no token was seen."""

    def __init__(self, device_mesh: Any = None, process_group: Any = None):
        super().__init__(device_mesh, process_group)
        self.reset()

    def reset(self) -> None:
        self.total_correct = 0
        self.total_count = 0

    def accumulate(self, inputs: Any, outputs: Any, **kwargs: Any) -> None:
        if outputs.get("num_correct") is not None:
            self.total_correct += int(outputs["num_correct"])
            self.total_count += int(outputs["num_tokens"])
            return
        logits = outputs.get("logits")
        if logits is None:
            return
        predicted = logits.argmax(dim=-1)
        labels = inputs["labels"].to(predicted.device)
        mask = inputs.get("completion_mask")
        if labels.shape != predicted.shape:  # logits of the last positions only
            labels = labels[..., -predicted.shape[-1] :]
            mask = None if mask is None else mask[..., -predicted.shape[-1] :]
        mask = labels != IGNORE_INDEX if mask is None else torch.as_tensor(mask, device=labels.device).bool()
        self.total_correct += int(((predicted == labels) & mask).sum())
        self.total_count += int(mask.sum())

    def calculate(self) -> dict[str, Any]:
        results = self.gather_results([(self.total_correct, self.total_count)])
        correct = sum(c for c, _ in results)
        total = sum(n for _, n in results)
        self.reset()
        if total == 0:
            return {}
        return {"accuracy": correct / total, "correct_tokens": correct, "total_tokens": total}
