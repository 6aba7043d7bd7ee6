"""Shared by the scoring tests: a tiny Llama with sharp distributions, rows that share prefixes,
and the float64 reference they are checked against.

Tolerance: the scored path runs fp32 (packed rows, oneDNN products, the head on the scored rows
only, log-sum-exp in place) and the reference float64 on each row alone; fp32 rounding in a
2-layer model of width 32 moves a log-probability by about 1e-6 of its size, and the sharp
model's log-probabilities stay below ~100 in size, so 1e-4 absolute bounds it with room, while a
misplaced position or a missing prefix moves them by far more than 1e-2."""

import copy

import torch
from tiny import TINY_LLAMA_SHAPE

ATOL = 1e-4
VOCAB = 97


def sharp_llama(seed: int = 0):
    """A random 2-layer Llama in eval mode, its final norm scaled so that its distributions are
    sharp (a random tiny model's are near uniform, where a misaligned score would go unnoticed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, **TINY_LLAMA_SHAPE, max_position_embeddings=128)
    lm = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        lm.model.norm.weight.mul_(20.0)
    return lm


def token_rows(seed: int = 0) -> list[dict[str, list[int]]]:
    """Rows of unequal lengths that all start with one 6-token prefix, the middle two also with
    one whole prompt (two completions of it); labels on the completions only."""
    g = torch.Generator().manual_seed(seed)

    def draw(n: int) -> list[int]:
        return torch.randint(1, VOCAB, (n,), generator=g).tolist()

    system, shared_prompt = draw(6), draw(4)
    prompts = [system + draw(3), system + shared_prompt, system + shared_prompt, system + draw(5)]
    rows = []
    for prompt, n in zip(prompts, (7, 3, 9, 5), strict=True):
        completion = draw(n)
        rows.append({"input_ids": prompt + completion, "labels": [-100] * len(prompt) + completion})
    return rows


def reference_logps(lm, ids: list[int]) -> torch.Tensor:
    """``(len(ids), vocab)`` float64 log-probabilities of the next token, the row run alone."""
    double = copy.deepcopy(lm).double()
    with torch.no_grad():
        logits = double(input_ids=torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits, dim=-1)


def assert_topk_matches(values: torch.Tensor, indices: torch.Tensor, ref: torch.Tensor) -> None:
    """``(values, indices)`` ``(N, k)`` are ``ref``'s ``(N, vocab)`` top ``k``: the values equal its
    largest ``k`` and its values at the ids given; the ids are its own wherever no two of its
    ``k + 1`` largest values lie within a rounding of each other (a near-tie may swap)."""
    k = values.shape[1]
    top, top_ids = ref.topk(min(k + 1, ref.shape[1]), dim=-1)
    torch.testing.assert_close(values.double(), top[:, :k], atol=ATOL, rtol=0)
    torch.testing.assert_close(ref.gather(1, indices), values.double(), atol=ATOL, rtol=0)
    apart = (top[:, :-1] - top[:, 1:]).min(1).values > 10 * ATOL
    assert bool(apart.any())
    assert torch.equal(indices[apart], top_ids[apart, :k])
