"""``EmbeddingMetric``: how well an embedding model's anchors find their positives, per
micro-batch of ``forward_backward(inputs, task='embedding')`` (``twinkle.loss.infonce``: groups
``anchor, positive, negatives...``, labels 1 at each anchor).

``calculate`` returns, over the groups of every rank: ``pos_sim`` (mean anchor-positive cosine
similarity), ``pos_sim_min``, ``pos_sim_max``, ``neg_sim`` (mean similarity of an anchor to the
batch's other documents) and ``retrieval_accuracy`` (the share of anchors whose most similar
document in their micro-batch is their positive: in-batch retrieval), and ``loss`` (the mean
InfoNCE loss over groups); ``{}`` when no group was seen."""

from typing import Any

import torch

from twinkle.metric.base import Metric


def retrieval(embeddings: torch.Tensor, marks: torch.Tensor) -> dict[str, float]:
    """Sums over one batch's groups: positive and negative similarities, hits, counts."""
    marks = torch.as_tensor(marks).reshape(-1).to(embeddings.device)
    anchors = (marks == 1).nonzero(as_tuple=True)[0]
    keep = anchors[anchors + 1 < marks.numel()]
    if keep.numel() == 0:
        return {}
    docs = (marks == 0).nonzero(as_tuple=True)[0]
    sims = embeddings[keep].double() @ embeddings[docs].double().T  # (G, docs)
    positive = docs[None, :] == (keep + 1)[:, None]  # each anchor's positive column
    pos = sims[positive]
    neg = sims[~positive]
    hits = (docs[sims.argmax(-1)] == keep + 1).sum()
    return {
        "pos_sum": float(pos.sum()),
        "pos_min": float(pos.min()),
        "pos_max": float(pos.max()),
        "neg_sum": float(neg.sum()),
        "neg_count": int(neg.numel()),
        "hits": int(hits),
        "groups": int(keep.numel()),
    }


class EmbeddingMetric(Metric):
    """See the module docstring; ``model.add_metric(EmbeddingMetric, is_training=True)``."""

    def __init__(self, device_mesh: Any = None, process_group: Any = None, **kwargs: Any):
        super().__init__(device_mesh, process_group)
        self.reset()

    def reset(self) -> None:
        self.parts: list[dict[str, float]] = []
        self.loss_sum, self.loss_groups = 0.0, 0

    def accumulate(self, inputs: Any, outputs: Any, **kwargs: Any) -> None:
        embeddings = outputs.get("embeddings")
        if embeddings is None:
            return
        part = retrieval(embeddings, inputs["labels"])
        if part:
            self.parts.append(part)
        loss, count = outputs.get("loss"), int(outputs.get("num_tokens") or 0)
        if loss is not None and count:
            self.loss_sum += float(loss)
            self.loss_groups += count

    def calculate(self) -> dict[str, Any]:
        local = [(self.parts, self.loss_sum, self.loss_groups)]
        gathered = self.gather_results(local)
        self.reset()
        parts = [p for rank_parts, _, _ in gathered for p in rank_parts]
        groups = sum(p["groups"] for p in parts)
        if not groups:
            return {}
        out = {
            "pos_sim": sum(p["pos_sum"] for p in parts) / groups,
            "pos_sim_min": min(p["pos_min"] for p in parts),
            "pos_sim_max": max(p["pos_max"] for p in parts),
            "retrieval_accuracy": sum(p["hits"] for p in parts) / groups,
        }
        negatives = sum(p["neg_count"] for p in parts)
        if negatives:
            out["neg_sim"] = sum(p["neg_sum"] for p in parts) / negatives
        loss_groups = sum(g for _, _, g in gathered)
        if loss_groups:
            out["loss"] = sum(s for _, s, _ in gathered) / loss_groups
        return out
