"""Upstream's metrics that Twinkle does not compute yet, importable by name so that a script gets
past its imports and stops, with one line, where it builds one."""

from typing import Any

from twinkle.metric.base import Metric
from twinkle.utils.errors import UserError


class EmbeddingMetric(Metric):
    """Similarities of anchor and positive embeddings: not built yet (embedding models are not
    trained here)."""

    def __init__(self, *args: Any, **kwargs: Any):
        raise UserError("EmbeddingMetric: not supported yet: metrics of embedding-model training")
