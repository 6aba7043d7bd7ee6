"""Training and evaluation metrics, reduced over ranks: ``TokenMetrics``.

Public names: ``TokenMetrics``."""

from twinkle.metric.token_metrics import TokenMetrics

__all__ = ["TokenMetrics"]
