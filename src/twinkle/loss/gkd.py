"""``GKDLoss``: generalized knowledge distillation, the student matching a teacher's next-token
distributions with a generalized Jensen-Shannon divergence (Agarwal et al. 2024, "On-Policy
Distillation of Language Models", arXiv 2306.13649).

At each supervised position, with the student's logits ``s`` and the teacher's log-probabilities
``t`` over a token set ``K``, both at temperature ``tau`` and renormalised over ``K``::

    p_S(i) = exp(s_i / tau) / sum_{j in K} exp(s_j / tau)
    p_T(i) = exp(t_i / tau) / sum_{j in K} exp(t_j / tau)
    M      = beta * p_T + (1 - beta) * p_S
    JSD_beta = beta * KL(p_T || M) + (1 - beta) * KL(p_S || M)      (0 < beta < 1)
    beta = 0: KL(p_T || p_S), the forward KL (mean-seeking)
    beta = 1: KL(p_S || p_T), the reverse KL (mode-seeking)

``K`` is the teacher's top-k tokens at that position (``teacher_topk_logprobs`` with
``teacher_topk_indices``, what a sampler's ``SamplingParams(prompt_logprobs=k)`` returns; or the
``topk`` largest of full ``teacher_logits``); the teacher mass outside ``K`` is dropped and both
distributions are renormalised over ``K``, as upstream does, so that a remote teacher that sends
only k numbers per token and an in-process one give the same loss. Without ``topk``, full
``teacher_logits`` make ``K`` the whole vocabulary. Renormalising log-probabilities over ``K``
equals renormalising the raw logits, so top-k log-probabilities taken at temperature 1 serve any
``tau``. The loss is the mean divergence over every supervised token of the global batch; the
model reports it as ``loss`` and the share of tokens whose most likely token in ``K`` is the
teacher's as ``top1_agreement``.

The teacher tensors are upstream's layout: ``(B, L, k)`` aligned with the model's predictions,
position ``i`` holding the teacher's distribution of token ``i + 1`` (a sampler's per-token
scores rolled left by one, ``topk_prompt_inputs``). A model step takes them as keywords::

    model.set_loss(GKDLoss(beta=0.5, temperature=1.0))
    model.forward_backward(inputs=rows, teacher_topk_logprobs=lps, teacher_topk_indices=ids)
    model.forward_backward(inputs=rows, teacher_logits=logits)   # an in-process teacher"""

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from twinkle.loss.base import ROWS, HeadLoss, LossView
from twinkle.loss.head import head_logits
from twinkle.loss.output import IGNORE_INDEX, LossOutput
from twinkle.loss.upstream_keywords import check_ignore_index
from twinkle.utils.errors import UserError

LOGPS, INDICES, LOGITS = "teacher_topk_logprobs", "teacher_topk_indices", "teacher_logits"
# an index row of this one value stands for the whole vocabulary in order (full teacher logits),
# so the (tokens, vocab) index tensor is never built
ALL_TOKENS = -1
# a teacher log-probability of -inf (a token it rules out) is read as this: the reverse KL stays
# finite and the token's weight stays 0 to fp32 precision
FLOOR = -1e4


def _fp(tensor: Any) -> torch.Tensor:
    """fp32, or fp64 as given (a reference computation keeps its precision)."""
    tensor = torch.as_tensor(tensor)
    return tensor if tensor.dtype == torch.float64 else tensor.float()


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise UserError(f"GKDLoss: {name} must be a finite number, got {value!r}")
    return float(value)


def generalized_jsd(
    student_logits: torch.Tensor, teacher_logps: torch.Tensor, beta: float, temperature: float
) -> torch.Tensor:
    """The module docstring's ``JSD_beta`` of each row (``(N,)``) over the last dimension, both
    sides renormalised over it at ``temperature``."""
    s = torch.log_softmax(student_logits / temperature, dim=-1)
    t = torch.log_softmax(teacher_logps.clamp(min=FLOOR) / temperature, dim=-1)
    if beta == 0:
        return (t.exp() * (t - s)).sum(-1)
    if beta == 1:
        return (s.exp() * (s - t)).sum(-1)
    m = torch.logsumexp(torch.stack([t + math.log(beta), s + math.log1p(-beta)]), dim=0)
    return beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)


class GKDLoss(HeadLoss):
    """See the module docstring. ``beta`` in [0, 1]: the teacher's weight in the mixture (0:
    forward KL, 1: reverse KL); ``temperature`` > 0; ``topk``: keep the teacher's ``topk`` most
    likely tokens (of full logits, or of more top-k values than that); ``chunk_size``: rows whose
    logits are built at once (the student's ``(rows, vocab)`` logits are the step's largest
    tensor)."""

    consumes = ROWS
    reduction = "mean"
    extra_inputs = (LOGPS, INDICES)
    sequence_parallel = True  # a sum over scored positions: each Ulysses rank sums its own
    step_keywords = (LOGITS, "topk")  # taken by the step and turned into the two above (batch_inputs)
    correct_metric = "top1_agreement"

    def __init__(
        self,
        beta: float = 0.5,
        temperature: float = 1.0,
        topk: int | None = None,
        ignore_index: int = IGNORE_INDEX,
        chunk_size: int = 512,
    ):
        self.beta = _number("beta", beta)
        if not 0 <= self.beta <= 1:
            raise UserError(f"GKDLoss: beta must be in [0, 1] (0: forward KL, 1: reverse KL), got {beta!r}")
        self.temperature = _number("temperature", temperature)
        if self.temperature <= 0:
            raise UserError(f"GKDLoss: temperature must be > 0, got {temperature!r}")
        if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int) or topk < 1):
            raise UserError(f"GKDLoss: topk must be a whole number >= 1 or None (every token), got {topk!r}")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise UserError(f"GKDLoss: chunk_size must be a whole number >= 1, got {chunk_size!r}")
        self.topk, self.chunk_size = topk, chunk_size
        self.ignore_index = check_ignore_index(self.name, ignore_index)

    # ----------------------------------------------------------------- the teacher's tensors
    def teacher_set(self, given: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log-probabilities, indices)`` ``(..., k)`` from the teacher's keywords: full
        ``teacher_logits`` (their ``topk`` largest, or every token) or top-k values already
        taken (cut to ``topk`` when they hold more)."""
        topk = self.topk if given.get("topk") is None else given["topk"]
        if given.get(LOGITS) is not None:
            if given.get(LOGPS) is not None:
                raise UserError("GKDLoss: pass teacher_logits= or teacher_topk_logprobs=, not both")
            logits = _fp(given[LOGITS])
            vocab = logits.shape[-1]
            if topk is not None and topk > vocab:
                raise UserError(f"GKDLoss: topk={topk} is larger than the vocabulary ({vocab} tokens)")
            logps = torch.log_softmax(logits, dim=-1)
            if topk is None:
                return logps, torch.full((*logps.shape[:-1], 1), ALL_TOKENS, device=logps.device)
            return logps.topk(topk, dim=-1)
        logps, indices = given.get(LOGPS), given.get(INDICES)
        if logps is None or indices is None:
            raise UserError(
                "GKDLoss needs the teacher: teacher_topk_logprobs= with teacher_topk_indices=, or teacher_logits="
            )
        logps, indices = _fp(logps), torch.as_tensor(indices).long()
        if logps.shape != indices.shape:
            raise UserError(
                f"GKDLoss: teacher_topk_logprobs {tuple(logps.shape)} and teacher_topk_indices "
                f"{tuple(indices.shape)} must have the same shape"
            )
        if topk is not None and logps.shape[-1] > topk:
            logps, order = logps.topk(topk, dim=-1)
            indices = indices.gather(-1, order)
        return logps, indices

    def batch_inputs(self, given: Mapping[str, Any], labels: torch.Tensor) -> dict[str, Any]:
        """The step's keywords as the model's extra inputs: the teacher's ``(B, L, k)`` tensors in
        upstream's layout, cut or padded to the batch's length ``L``, shifted right by one into
        the labels' layout the model shifts back (``twinkle.model.loss_inputs``)."""
        out = {k: v for k, v in given.items() if k not in (LOGPS, INDICES, LOGITS, "topk")}
        if not any(given.get(k) is not None for k in (LOGPS, INDICES, LOGITS)):
            return out
        logps, indices = self.teacher_set(given)
        rows, length = int(labels.shape[0]), int(labels.shape[1])
        if logps.dim() != 3 or logps.shape[0] != rows:
            raise UserError(
                f"GKDLoss: the teacher's tensors have shape {tuple(logps.shape)}, but the batch has {rows} rows; "
                f"pass ({rows}, length, k), one row per batch row"
            )
        logps, indices = _fit_length(logps, length), _fit_length(indices, length)
        out[LOGPS], out[INDICES] = logps.roll(1, dims=1), indices.roll(1, dims=1)
        return out

    # ----------------------------------------------------------------- the protocol
    def compute(self, view: LossView) -> LossOutput:
        logps, indices = view.extras[LOGPS], view.extras[INDICES].long()
        rows = int(view.targets.shape[0])
        student = view.hidden if view.hidden is not None else view.logits
        if student is None:
            raise UserError(
                "GKDLoss needs the student's hidden states or logits; run it through model.set_loss"
            )
        if rows == 0:  # a rank's empty share: backward must still run
            zero = student.sum() * 0.0
            return LossOutput(zero, zero, 0, torch.zeros((), dtype=torch.long))
        vocab = int(view.weight.shape[0]) if view.hidden is not None else int(view.logits.shape[-1])
        _check_teacher(logps, indices, vocab, self.topk)
        total = 0.0
        agree = torch.zeros((), dtype=torch.long, device=student.device)
        for start in range(0, rows, self.chunk_size):
            part = slice(start, start + self.chunk_size)
            logits = (
                head_logits(view.hidden[part], view.weight, view.bias)
                if view.hidden is not None
                else view.logits[part]
            )
            logits = _fp(logits)
            s, t = _on_teacher_set(logits, logps[part].to(logits.device), indices[part].to(logits.device))
            total = total + generalized_jsd(s, t, self.beta, self.temperature).sum()
            agree += (s.detach().argmax(-1) == t.argmax(-1)).sum()
        return LossOutput(total / rows, total, rows, agree)

    def upstream_batch(self, inputs: dict[str, Any], outputs: Mapping[str, Any]) -> dict[str, Any]:
        """Upstream's call, ``loss(inputs, outputs, teacher_topk_logprobs=...,
        teacher_topk_indices=...)`` or ``teacher_logits=`` (``topk=`` cuts full logits): the
        teacher's tensors come aligned with ``inputs["labels"]`` (already shifted, -100 where no
        target) and ``outputs["logits"]``; the result is ``{"loss": mean, "num_tokens": 0}``."""
        length = torch.as_tensor(inputs["labels"]).shape[1]
        logps, indices = self.teacher_set(inputs)
        for key in (LOGITS, "topk"):
            inputs.pop(key, None)
        inputs[LOGPS], inputs[INDICES] = _fit_length(logps, length), _fit_length(indices, length)
        return inputs


def _fit_length(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """``tensor`` ``(B, L', k)`` cut or zero-padded to ``(B, length, k)`` (a padded position
    carries no label)."""
    have = tensor.shape[1]
    if have >= length:
        return tensor[:, :length]
    pad = tensor.new_zeros((tensor.shape[0], length - have, tensor.shape[2]))
    return torch.cat([tensor, pad], dim=1)


def _check_teacher(logps: torch.Tensor, indices: torch.Tensor, vocab: int, topk: int | None) -> None:
    """One line for a teacher whose tensors cannot be the student's vocabulary's."""
    full = indices.shape[-1] == 1 and bool((indices == ALL_TOKENS).all())
    if full and logps.shape[-1] != vocab:
        raise UserError(
            f"GKDLoss: the teacher's logits cover {logps.shape[-1]} tokens, the student's vocabulary {vocab}: "
            "the teacher has another tokenizer; distil from a teacher with the student's vocabulary"
        )
    if not full:
        if topk is not None and topk > vocab:
            raise UserError(f"GKDLoss: topk={topk} is larger than the vocabulary ({vocab} tokens)")
        if indices.shape[-1] > vocab:
            raise UserError(
                f"GKDLoss: {indices.shape[-1]} teacher tokens per position, more than the vocabulary ({vocab})"
            )
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= vocab):
            raise UserError(
                f"GKDLoss: the teacher's token ids reach {int(indices.max())}, outside the student's vocabulary "
                f"of {vocab}: the teacher has another tokenizer; distil from a teacher with the student's vocabulary"
            )


def _on_teacher_set(
    logits: torch.Tensor, logps: torch.Tensor, indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The student's logits and the teacher's log-probabilities over the teacher's token set."""
    if indices.shape[-1] == 1 and logps.shape[-1] == logits.shape[-1] and bool((indices == ALL_TOKENS).all()):
        return logits, logps
    return logits.gather(-1, indices), logps


def topk_prompt_inputs(scores: Sequence[Any], topk: int) -> dict[str, torch.Tensor]:
    """``forward_backward``'s teacher keywords from a sampler's per-token top-k scores:
    ``scores`` holds, per row, a ``SampleResponse`` (its ``topk_prompt_logprobs``) or that list
    itself, ``[None, [(token_id, logprob), ...], ...]`` with position ``i`` scoring token ``i``.
    Returns ``{teacher_topk_logprobs, teacher_topk_indices}`` ``(B, L, topk)`` in upstream's
    layout (rolled left by one: position ``i`` scores token ``i + 1``), zero where no score."""
    lists = [getattr(s, "topk_prompt_logprobs", s) for s in scores]
    if any(s is None for s in lists):
        raise UserError(
            "a teacher response has no topk_prompt_logprobs; sample it with SamplingParams(prompt_logprobs=k)"
        )
    length = max(len(s) for s in lists) if lists else 0
    logps = torch.zeros((len(lists), length, topk))
    indices = torch.zeros((len(lists), length, topk), dtype=torch.long)
    for row, per_token in enumerate(lists):
        for pos, top in enumerate(per_token):
            if not top:
                continue
            if len(top) < topk:
                raise UserError(
                    f"row {row} position {pos} has {len(top)} teacher tokens, fewer than topk={topk}; "
                    f"score with SamplingParams(prompt_logprobs={topk})"
                )
            ids, values = zip(*top[:topk], strict=True)
            indices[row, pos], logps[row, pos] = torch.tensor(ids), torch.tensor(values)
    return {LOGPS: logps.roll(-1, dims=1), INDICES: indices.roll(-1, dims=1)}
