"""Pick the next token of each row from its logits: greedy, or sampled with temperature, top-k
and top-p from a given ``torch.Generator``; and the log-probabilities reported for it.

The reported log-probabilities are those of the model itself (``log_softmax`` of the raw
logits, temperature 1, no top-k/top-p), which is what a training forward computes for the same
tokens: the "old" log-probabilities of a policy-gradient loss."""

import torch

from twinkle.data_format.sampling import SamplingParams

CANDIDATES = 64  # tokens a top-p draw first looks among (see ``_sample_nucleus``)


def choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """``(rows, vocab)`` fp32 logits -> ``(rows,)`` token ids."""
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    scores = logits / params.temperature if params.temperature != 1 else logits
    vocab = scores.shape[-1]
    top_k = params.top_k if 0 < params.top_k < vocab else vocab
    if params.top_p < 1:
        return _sample_nucleus(scores, top_k, params.top_p, generator)
    if top_k < vocab:
        values, indices = scores.topk(top_k, dim=-1)
        picked = torch.multinomial(values.softmax(dim=-1), 1, generator=generator)
        return indices.gather(-1, picked).squeeze(-1)
    return torch.multinomial(scores.softmax(dim=-1), 1, generator=generator).squeeze(-1)


def _sample_nucleus(
    scores: torch.Tensor, top_k: int, top_p: float, generator: torch.Generator
) -> torch.Tensor:
    """Sample among the ``top_k`` most likely tokens the smallest set whose probability reaches
    ``top_p`` (the most likely token always stays).

    The set is found among the ``CANDIDATES`` most likely tokens (a partial selection, not a
    sort of the vocabulary) for every row where they already hold ``top_p`` of the probability,
    which is then the same set a full sort finds; the other rows sort all ``top_k``."""
    vocab = scores.shape[-1]
    if top_k < vocab or vocab <= CANDIDATES:
        values, indices = scores.topk(top_k, dim=-1)  # sorted, descending
        return _draw(values.softmax(dim=-1), indices, top_p, generator)
    values, indices = scores.topk(CANDIDATES, dim=-1)
    probs = (values - scores.logsumexp(dim=-1, keepdim=True)).exp()
    covered = probs.sum(dim=-1) >= top_p
    if bool(covered.all()):
        return _draw(probs, indices, top_p, generator)
    out = torch.empty(scores.shape[0], dtype=torch.long, device=scores.device)
    if bool(covered.any()):
        out[covered] = _draw(probs[covered], indices[covered], top_p, generator)
    rest = ~covered
    values, indices = scores[rest].sort(dim=-1, descending=True)
    out[rest] = _draw(values.softmax(dim=-1), indices, top_p, generator)
    return out


def _draw(
    probs: torch.Tensor, indices: torch.Tensor, top_p: float, generator: torch.Generator
) -> torch.Tensor:
    """``probs``: each row's probabilities in descending order, of the tokens ``indices``."""
    before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above each one
    probs = probs.masked_fill(before >= top_p, 0.0)
    picked = torch.multinomial(probs, 1, generator=generator)
    return indices.gather(-1, picked).squeeze(-1)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, alternatives: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The model's log-probability of each row's ``tokens`` (temperature 1), and with
    ``alternatives > 0`` the ``alternatives + 1`` most likely tokens and their log-probabilities
    (one more than asked, so that ``alternatives`` remain once the sampled token is left out)."""
    logps = torch.log_softmax(logits, dim=-1)
    chosen = logps.gather(-1, tokens[:, None]).squeeze(-1)
    if alternatives <= 0:
        return chosen, None, None
    top_values, top_ids = logps.topk(min(alternatives + 1, logps.shape[-1]), dim=-1)
    return chosen, top_ids, top_values
