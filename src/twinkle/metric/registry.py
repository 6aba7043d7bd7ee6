"""Metric names accepted by ``model.add_metric``."""

from typing import Any

from twinkle.metric.accuracy import Accuracy
from twinkle.metric.base import Metric
from twinkle.metric.completion_reward import CompletionRewardMetric
from twinkle.metric.dpo import DPOMetric
from twinkle.metric.embedding import EmbeddingMetric
from twinkle.metric.grpo import CISPOMetric, GRPOMetric, GSPOMetric
from twinkle.metric.loss import LossMetric
from twinkle.metric.train_metric import TrainMetric
from twinkle.utils.errors import UserError

METRICS: dict[str, type[Metric]] = {
    "Accuracy": Accuracy,
    "LossMetric": LossMetric,
    "TrainMetric": TrainMetric,
    "DPOMetric": DPOMetric,
    "CompletionRewardMetric": CompletionRewardMetric,
    "GRPOMetric": GRPOMetric,
    "GSPOMetric": GSPOMetric,
    "CISPOMetric": CISPOMetric,
    "EmbeddingMetric": EmbeddingMetric,
}


def build_metric(metric_cls: Any, device_mesh: Any = None, process_group: Any = None, **kwargs: Any) -> Any:
    """A metric from a name in ``METRICS`` or a class, built with ``(device_mesh, process_group)``
    and ``kwargs``; an object with ``accumulate`` and ``calculate`` is returned as it is."""
    if isinstance(metric_cls, str):
        if metric_cls not in METRICS:
            raise UserError(f"unknown metric {metric_cls!r}; valid names: {', '.join(METRICS)}")
        metric_cls = METRICS[metric_cls]
    if not isinstance(metric_cls, type):
        if not (hasattr(metric_cls, "accumulate") and hasattr(metric_cls, "calculate")):
            raise UserError(
                f"{metric_cls!r} is not a metric; pass a name ({', '.join(METRICS)}), a Metric class or instance"
            )
        if kwargs:
            raise UserError(
                f"add_metric got a metric instance and keywords {sorted(kwargs)}; pass one or the other"
            )
        return metric_cls
    try:
        return metric_cls(device_mesh=device_mesh, process_group=process_group, **kwargs)
    except TypeError as exc:
        raise UserError(f"metric {metric_cls.__name__}: {exc}") from exc
