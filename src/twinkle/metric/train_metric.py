"""``TrainMetric``: learning rate, optimizer steps and their rate since the last read."""

import time
from typing import Any

from twinkle.metric.base import Metric


class TrainMetric(Metric):
    """Reads its context, not the batch: ``lr`` (a number, or one per parameter group), ``step``
    (micro-batches so far) and ``gradient_accumulation_steps``. ``calculate`` returns numbers:
    ``lr`` (or ``lr/group<i>`` for several groups), ``iters`` (``step`` // accumulation steps),
    ``elapsed_seconds`` (since the metric was built) and ``iters_per_second`` (since the last
    ``calculate``). The same on every rank, so nothing is reduced."""

    def __init__(self, device_mesh: Any = None, process_group: Any = None):
        super().__init__(device_mesh, process_group)
        self.lr: float | list[float] | None = None
        self.step: int | None = None
        self.last_step = 0
        self.gradient_accumulation_steps = 1
        self.start_time = self.time = time.perf_counter()

    def accumulate(
        self,
        inputs: Any,
        outputs: Any,
        lr: float | list[float] | None = None,
        step: int | None = None,
        gradient_accumulation_steps: int | None = None,
        **kwargs: Any,
    ) -> None:
        if lr is not None:
            self.lr = [float(x) for x in lr] if isinstance(lr, list | tuple) else float(lr)
        if step is not None:
            self.step = int(step)
        if gradient_accumulation_steps is not None:
            self.gradient_accumulation_steps = int(gradient_accumulation_steps)

    def reset(self) -> None:
        self.time = time.perf_counter()
        self.last_step = self.step or 0

    def calculate(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        lr = self.lr[0] if isinstance(self.lr, list) and len(self.lr) == 1 else self.lr
        if isinstance(lr, list):
            out.update({f"lr/group{i}": value for i, value in enumerate(lr)})
        elif lr is not None:
            out["lr"] = lr
        if self.step is not None:
            now = time.perf_counter()
            accumulation = max(1, self.gradient_accumulation_steps)
            out["iters"] = self.step // accumulation
            out["elapsed_seconds"] = now - self.start_time
            out["iters_per_second"] = (self.step - self.last_step) / accumulation / max(now - self.time, 1e-9)
        self.reset()
        return out
