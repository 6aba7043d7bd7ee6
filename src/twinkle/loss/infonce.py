"""``InfonceLoss``: the contrastive loss of embedding training (``forward_backward(inputs,
task='embedding')``).

A batch is groups of rows, ``anchor, positive, negative_1, ..., negative_n`` (``n >= 0``), each
row one text; a row's ``labels`` is 1 where a group starts (its anchor) and 0 otherwise, as
upstream lays it out. The model pools each row into one L2-normalised embedding
(``twinkle.model.embedding``); with ``q_g`` group ``g``'s anchor and ``D`` the documents (every
row but the anchors) the loss sees, ``d_g`` the group's positive::

    loss = mean_g  -log( exp(q_g . d_g / T) / sum_{d in D} exp(q_g . d / T) )

``use_batch=True``: ``D`` is every group's documents (in-batch negatives: the other groups'
positives and negatives); ``use_batch=False``: only the group's own. ``hard_negatives=n`` gives
every group exactly ``n`` negatives (its first ``n``, or its own repeated in order when it has
fewer). The model counts the groups: a step is the mean over every group of the global batch,
and ``retrieval_accuracy`` is the share of anchors whose most similar document is their positive.
Each rank draws its in-batch negatives from its own rows."""

from collections.abc import Mapping
from typing import Any

import torch

from twinkle.loss.base import EMBEDDINGS, Loss
from twinkle.loss.output import LossOutput
from twinkle.utils.errors import UserError

POOLINGS = ("last", "mean")


def group_starts(marks: torch.Tensor) -> list[int]:
    """The rows that start a group, from the ``labels`` marks (1 at each anchor)."""
    marks = torch.as_tensor(marks).reshape(-1)
    rows = int(marks.numel())
    if rows < 2:
        raise UserError(
            f"InfonceLoss needs at least an anchor and its positive in a batch (2 rows), got {rows} row(s)"
        )
    starts = (marks == 1).nonzero(as_tuple=True)[0].tolist()
    if not starts or starts[0] != 0:
        raise UserError(
            "InfonceLoss: the batch's first row must start a group (labels 1 at each anchor, 0 after)"
        )
    ends = starts[1:] + [rows]
    short = [s for s, e in zip(starts, ends, strict=True) if e - s < 2]
    if short:
        raise UserError(
            f"InfonceLoss: the group starting at row {short[0]} has no positive (an anchor needs one)"
        )
    return starts


def similarity_logits(
    embeddings: torch.Tensor,
    starts: list[int],
    use_batch: bool,
    hard_negatives: int | None,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits (G, docs), targets (G,))``: each anchor against the documents, over ``temperature``;
    a document it may not see (another group's, without ``use_batch``) is -inf."""
    rows = embeddings.shape[0]
    ends = starts[1:] + [rows]
    docs, owner, targets = [], [], []
    for g, (s, e) in enumerate(zip(starts, ends, strict=True)):
        mine = list(range(s + 1, e))
        if hard_negatives is not None:
            negatives = mine[1:]
            if negatives:
                negatives = [negatives[i % len(negatives)] for i in range(hard_negatives)]
            elif hard_negatives:
                raise UserError(
                    f"InfonceLoss(hard_negatives={hard_negatives}): the group at row {s} has no negative"
                )
            mine = mine[:1] + negatives
        targets.append(len(docs))
        docs += mine
        owner += [g] * len(mine)
    anchors = embeddings[torch.tensor(starts, device=embeddings.device)]
    bank = embeddings[torch.tensor(docs, device=embeddings.device)]
    logits = anchors @ bank.T / temperature
    if not use_batch:
        own = (
            torch.tensor(owner, device=logits.device)[None, :]
            == torch.arange(len(starts), device=logits.device)[:, None]
        )
        logits = logits.masked_fill(~own, float("-inf"))
    return logits, torch.tensor(targets, device=logits.device)


class InfonceLoss(Loss):
    """See the module docstring. ``temperature`` > 0 divides the cosine similarities;
    ``use_batch``: in-batch negatives; ``hard_negatives``: each group's negative count (None:
    as given); ``pooling``: ``last`` (the last real token's hidden state, upstream's) or ``mean``
    (the mean over the row's real tokens). Upstream's ``mask_fake_negative``, ``include_qq``,
    ``include_dd`` and ``process_group`` are taken at their defaults only."""

    consumes = EMBEDDINGS
    require_logps = False
    correct_metric = "retrieval_accuracy"

    def __init__(
        self,
        temperature: float = 0.1,
        use_batch: bool = True,
        hard_negatives: int | None = None,
        mask_fake_negative: bool = False,
        fake_neg_margin: float = 0.1,
        include_qq: bool = False,
        include_dd: bool = False,
        process_group: Any = None,
        pooling: str = "last",
    ):
        if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not temperature > 0:
            raise UserError(f"InfonceLoss: temperature must be a number > 0, got {temperature!r}")
        if hard_negatives is not None and (
            isinstance(hard_negatives, bool) or not isinstance(hard_negatives, int) or hard_negatives < 0
        ):
            raise UserError(
                f"InfonceLoss: hard_negatives must be a whole number >= 0 or None, got {hard_negatives!r}"
            )
        if pooling not in POOLINGS:
            raise UserError(f"InfonceLoss: pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        for name, value in (
            ("mask_fake_negative", mask_fake_negative),
            ("include_qq", include_qq),
            ("include_dd", include_dd),
        ):
            if value:
                raise UserError(f"InfonceLoss: not supported yet: {name}=True; leave it False")
        if process_group is not None:
            raise UserError(
                "InfonceLoss: not supported yet: process_group= (each rank uses its own rows as negatives)"
            )
        self.temperature, self.use_batch, self.hard_negatives = (
            float(temperature),
            bool(use_batch),
            hard_negatives,
        )
        self.mask_fake_negative, self.fake_neg_margin = False, fake_neg_margin
        self.include_qq, self.include_dd, self.process_group, self.pooling = False, False, None, pooling

    def from_embeddings(self, embeddings: torch.Tensor, marks: torch.Tensor) -> LossOutput:
        """The loss of pooled ``embeddings`` ``(B, D)`` with the group ``marks`` ``(B,)``: the
        sum over groups, their count, and the anchors whose top document is their positive."""
        starts = group_starts(marks)
        logits, targets = similarity_logits(
            embeddings, starts, self.use_batch, self.hard_negatives, self.temperature
        )
        if logits.shape[1] < 2:
            raise UserError(
                "InfonceLoss: one pair and no negative is no contrast; batch several pairs (use_batch=True) "
                "or give negatives"
            )
        logits = logits if logits.dtype == torch.float64 else logits.float()  # a float64 reference stays so
        per_group = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
        correct = (logits.detach().argmax(-1) == targets).sum()
        total = per_group.sum()
        return LossOutput(total / len(starts), total, len(starts), correct)

    def __call__(
        self, inputs: Mapping[str, Any], outputs: Mapping[str, Any], **kwargs: Any
    ) -> dict[str, Any]:
        """Upstream's call: ``outputs["embeddings"]`` ``(B, D)``, ``inputs["labels"]`` the marks;
        returns ``{"loss": mean over groups, "num_tokens": 0}``."""
        if kwargs:
            raise UserError(f"InfonceLoss: unexpected keyword(s) {sorted(kwargs)}")
        embeddings = outputs.get(EMBEDDINGS)
        if embeddings is None:
            raise UserError("InfonceLoss needs outputs['embeddings']; run the step with task='embedding'")
        out = self.from_embeddings(embeddings, torch.as_tensor(inputs["labels"]).reshape(-1))
        return {"loss": out.loss, "num_tokens": 0}
