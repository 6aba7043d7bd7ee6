"""What a sample request asks to compute on its prompt, and that computation over the model's
next-token log-probs of the prompt (one forward pass; ``ModelCore.score_prompt``).

Row ``i`` of those log-probs is the distribution over prompt token ``i + 1``. Every reported
log-prob is the model's own (log-softmax of the logits, temperature 1), as for the sampled
tokens: the temperature only shapes what ``prompt_alt_tokens`` draws, never what it reports."""

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class Scoring:
    """What a sample request asks to score besides the completions."""

    prompt: bool = False  # prompt_logprobs
    last_n: int | None = None  # prompt_logprobs_last_n: only the last n prompt tokens (and their top-k)
    topk_prompt: int = 0
    topk_sample: int = 0
    # target_prompt_logprobs as cells (row, token id; -1 asks for nothing), in the request's order:
    # row-major for a dense tensor, the CSR values' order for a sparse one
    target_rows: np.ndarray | None = None
    target_ids: np.ndarray | None = None
    target_shape: tuple[int, int] = (0, 0)
    target_csr: tuple[list[int], list[int]] | None = None  # (crow, col) of a sparse request
    alt_k: int = 0  # prompt_alt_tokens_k
    temperature: float = 1.0  # what prompt_alt_tokens draws at
    seed: int = 0  # what prompt_alt_tokens draws with

    @property
    def of_prompt(self) -> bool:
        """Whether anything is computed on the prompt."""
        return bool(self.prompt or self.topk_prompt or self.target_ids is not None or self.alt_k)


SENTINEL = (0, -99999.0)  # the SDK's empty top-k entry (tinker.types.topk_logprobs.MASK_LOGPROB)


def topk(rows: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` most likely tokens of each row: (ids, log-probs), each (rows, k)."""
    logps, ids = rows.topk(k, dim=-1)
    return ids.numpy(), logps.numpy()


def draw(rows: torch.Tensor, k: int, temperature: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``k`` tokens per row drawn independently, with replacement, from ``softmax(logits / T)``
    (the full distribution: no top-k or top-p), by a generator seeded with ``seed`` on the CPU, so
    the same request draws the same tokens on any device. Temperature 0 draws the most likely
    token (as the sampler's greedy choice). (int64 ids, float32 model log-probs), each (rows, k)."""
    if rows.shape[0] == 0:
        return np.zeros((0, k), dtype=np.int64), np.zeros((0, k), dtype=np.float32)
    if temperature == 0:
        ids = rows.argmax(dim=-1, keepdim=True).expand(-1, k)
    else:
        # log-probs differ from the logits by a constant per row; shifted so the best is 0, a tiny
        # temperature sends the others to -inf (probability 0), never the best one
        scores = (rows - rows.max(dim=-1, keepdim=True).values) / temperature
        generator = torch.Generator().manual_seed(seed)
        ids = torch.multinomial(scores.softmax(dim=-1), k, replacement=True, generator=generator)
    return ids.numpy().astype(np.int64), rows.gather(1, ids).numpy().astype(np.float32)


def score_rows(rows: torch.Tensor, prompt: list[int], want: Scoring) -> dict[str, Any]:
    """The prompt's scores from ``rows`` (``len(prompt) - 1`` rows of fp32 log-probs): ``prompt``
    (float32, one per prompt token, NaN where not scored), ``topk_prompt`` (ids, log-probs) of
    shape (prompt length, k), ``target`` (float32, one per target cell, 0 for an id of -1) and
    ``alt`` (ids, log-probs) of shape (prompt length - 1, k); each only when asked for."""
    first = 1 if want.last_n is None else len(prompt) - want.last_n  # the first scored position
    out: dict[str, Any] = {}
    if want.prompt:
        picked = rows.gather(1, torch.tensor(prompt[1:], dtype=torch.long)[:, None]).squeeze(1).numpy()
        out["prompt"] = np.full(len(prompt), np.nan, dtype=np.float32)
        out["prompt"][first:] = picked[first - 1 :]
    if want.topk_prompt:
        ids = np.full((len(prompt), want.topk_prompt), SENTINEL[0], dtype=np.int32)
        logps = np.full((len(prompt), want.topk_prompt), SENTINEL[1], dtype=np.float32)
        ids[first:], logps[first:] = topk(rows[first - 1 :], want.topk_prompt)
        out["topk_prompt"] = (ids, logps)
    if want.target_ids is not None:
        asked = torch.from_numpy(want.target_ids)
        picked = rows[torch.from_numpy(want.target_rows), asked.clamp(min=0)]
        out["target"] = torch.where(asked >= 0, picked, torch.zeros(())).numpy().astype(np.float32)
    if want.alt_k:
        out["alt"] = draw(rows, want.alt_k, want.temperature, want.seed)
    return out
