"""Training and evaluation metrics, reduced over ranks.

Public names: ``TokenMetrics`` (the model's built-in numbers), ``Metric``, ``Accuracy``,
``LossMetric``, ``TrainMetric``, ``DPOMetric``, ``CompletionRewardMetric``, ``GRPOMetric``,
``GSPOMetric``, ``CISPOMetric``, ``EmbeddingMetric`` (embedding training: in-batch retrieval),
``METRICS``, ``build_metric``.

A run's record (``metrics.jsonl``, ``--report-to`` sinks, progress, summary and ``curves.png``)
lives in ``twinkle.metric.report``, which the model's step and metric calls feed."""

from twinkle.metric.accuracy import Accuracy
from twinkle.metric.base import Metric
from twinkle.metric.completion_reward import CompletionRewardMetric
from twinkle.metric.dpo import DPOMetric
from twinkle.metric.embedding import EmbeddingMetric
from twinkle.metric.grpo import CISPOMetric, GRPOMetric, GSPOMetric
from twinkle.metric.loss import LossMetric
from twinkle.metric.registry import METRICS, build_metric
from twinkle.metric.token_metrics import TokenMetrics
from twinkle.metric.train_metric import TrainMetric

__all__ = [
    "TokenMetrics",
    "Metric",
    "Accuracy",
    "LossMetric",
    "TrainMetric",
    "DPOMetric",
    "CompletionRewardMetric",
    "GRPOMetric",
    "GSPOMetric",
    "CISPOMetric",
    "EmbeddingMetric",
    "METRICS",
    "build_metric",
]
