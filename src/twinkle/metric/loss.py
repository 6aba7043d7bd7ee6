"""``LossMetric``: the mean token loss and the last gradient norm, over all ranks."""

from typing import Any

from twinkle.metric.base import Metric


class LossMetric(Metric):
    """With ``loss_reduction="sum"`` (what the model passes) each ``outputs["loss"]`` is a summed
    token loss and the metric is their total over the total ``outputs["num_tokens"]`` (counted
    from ``labels >= 0`` when absent); with ``mean``, the mean of the micro-batches' values.
    ``calculate`` returns ``loss``, and ``grad_norm`` (the largest over ranks of the last
    non-None value seen) when it is above 0, as numbers; ``{}`` when nothing was seen."""

    def __init__(self, device_mesh: Any = None, process_group: Any = None):
        super().__init__(device_mesh, process_group)
        self.reset()

    def reset(self) -> None:
        self.total_loss = 0.0
        self.total_count = 0
        self.num_tokens = 0
        self.grad_norm = 0.0

    def accumulate(
        self,
        inputs: Any,
        outputs: Any,
        loss_reduction: str = "mean",
        grad_norm: float | None = None,
        **kwargs: Any,
    ) -> None:
        if outputs.get("loss") is None:
            return
        if loss_reduction == "sum":
            tokens = outputs.get("num_tokens")
            if tokens is None:
                rows = inputs if isinstance(inputs, list) else [inputs]
                tokens = sum(int((row["labels"] >= 0).sum()) for row in rows)
            self.num_tokens += int(tokens)
        if grad_norm is not None:
            self.grad_norm = float(grad_norm)
        self.total_loss += float(outputs["loss"])
        self.total_count += 1

    def calculate(self) -> dict[str, Any]:
        results = self.gather_results([(self.total_loss, self.total_count, self.num_tokens, self.grad_norm)])
        loss = sum(r[0] for r in results)
        count = sum(r[1] for r in results)
        tokens = sum(r[2] for r in results)
        grad_norm = max(r[3] for r in results)
        self.reset()
        if count == 0:
            return {}
        out = {"loss": loss / tokens if tokens else loss / count}
        if grad_norm > 0:
            out["grad_norm"] = grad_norm
        return out
