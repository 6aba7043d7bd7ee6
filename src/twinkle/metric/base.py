"""``Metric``: upstream's base of the metrics ``model.add_metric`` takes.

A metric is built with ``(device_mesh, process_group)`` (the model passes its mesh and None),
gets ``accumulate(inputs, outputs, **context)`` once per micro-batch and returns its numbers
from ``calculate()``, which also resets it. ``gather_results`` collects a list of per-rank
results from every rank of ``process_group`` (None: all ranks), so every rank reports the same."""

from typing import Any

import torch.distributed as dist

from twinkle.distributed.collectives import is_distributed


class Metric:
    """What the model passes to ``accumulate``: ``inputs`` is the batch with ``labels`` shifted
    (each position's target, -100 where none); ``outputs`` holds ``loss`` (the micro-batch's
    summed token loss), ``num_tokens`` (its supervised tokens), ``num_correct`` (those whose
    target has the largest logit) and ``logits`` None (the model never builds them); the
    context is ``lr``, ``step`` (micro-batches so far), ``gradient_accumulation_steps``,
    ``grad_norm`` (None before the first clip) and ``loss_reduction`` (``sum``)."""

    def __init__(self, device_mesh: Any = None, process_group: Any = None):
        self.device_mesh = device_mesh
        self.process_group = process_group

    def accumulate(self, inputs: Any, outputs: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            f"{type(self).__name__} must implement accumulate(inputs, outputs, **kwargs)"
        )

    def calculate(self) -> dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} must implement calculate()")

    def reset(self) -> None:
        pass

    def gather_results(self, local_results: list[Any]) -> list[Any]:
        """Every rank's ``local_results`` concatenated (rank order); a collective when distributed."""
        if not is_distributed():
            return list(local_results)
        size = dist.get_world_size(self.process_group)
        gathered: list[Any] = [None] * size
        dist.all_gather_object(gathered, local_results, group=self.process_group)
        return [item for part in gathered for item in part]
