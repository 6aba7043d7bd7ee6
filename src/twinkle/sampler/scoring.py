"""``SamplingParams(prompt_logprobs=k)``: the model's log-probability of each prompt token given
the tokens before it, and the ``k`` most likely tokens at each position (temperature 1, as the
log-probabilities of sampled tokens).

``score_prompts`` scores a call's text prompts together, from one forward pass over them packed
end to end (``twinkle.model.scoring_topk``: a prefix the prompts share runs once, the head runs
once per distinct position), on the families that packing serves; a prompt with images, or a
model of another family, runs its own forward (``score_prompt``)."""

from collections.abc import Sequence
from typing import Any

import torch

from twinkle.model.packing import can_pack
from twinkle.model.scoring_topk import topk_at_targets, vocab_size
from twinkle.model.vision_positions import token_type_inputs
from twinkle.sampler.gemma_images import image_token_types, is_gemma
from twinkle.template.base import IGNORE_INDEX

PromptScores = tuple[list[float | None], list[list[tuple[int, float]] | None]]


@torch.no_grad()
def score_prompt(
    lm: Any, ids: list[int], k: int, vision: dict[str, torch.Tensor] | None = None
) -> PromptScores:
    """``(prompt_logprobs, topk_prompt_logprobs)`` of one prompt; both start with None (nothing
    predicts the first token). ``vision``: the prompt's images (``pixel_values``,
    ``image_grid_thw``), with which the model works out its M-RoPE positions; on Gemma the
    token types go with them (an image's tokens attend both ways)."""
    device = next(lm.parameters()).device
    tokens = torch.tensor([ids], device=device)
    images = {}
    if vision is not None:
        images = {key: value.to(device) for key, value in vision.items()}
        images.update(image_token_types(lm, tokens) if is_gemma(lm) else token_type_inputs(lm, tokens))
    logits = lm(input_ids=tokens, use_cache=False, **images).logits[0, :-1].float()
    logps = torch.log_softmax(logits, dim=-1)
    chosen = logps.gather(-1, tokens[0, 1:, None]).squeeze(-1).tolist()
    if k > 0:
        values, indices = logps.topk(min(k, logps.shape[-1]), dim=-1)
        top = [list(zip(i, v, strict=True)) for i, v in zip(indices.tolist(), values.tolist(), strict=True)]
    else:
        top = [[] for _ in chosen]
    return [None, *chosen], [None, *top]


def score_prompts(
    lm: Any, prompts: Sequence[Sequence[int]], k: int, visions: Sequence[Any] | None = None
) -> list[PromptScores]:
    """``score_prompt``'s value for each prompt (``visions``: each one's images or None); the text
    prompts of a packable model from one forward (see the module docstring)."""
    visions = list(visions) if visions is not None else [None] * len(prompts)
    together = [i for i, v in enumerate(visions) if v is None and len(prompts[i]) > 1] if can_pack(lm) else []
    out: list[PromptScores | None] = [None] * len(prompts)
    if together:
        for i, scores in zip(together, _scored_together(lm, [prompts[i] for i in together], k), strict=True):
            out[i] = scores
    for i, scores in enumerate(out):
        if scores is None:
            out[i] = score_prompt(lm, list(prompts[i]), k, visions[i])
    return out


@torch.no_grad()
def _scored_together(lm: Any, prompts: list[Sequence[int]], k: int) -> list[PromptScores]:
    device = next(lm.parameters()).device
    length = max(len(ids) for ids in prompts)
    ids = torch.zeros((len(prompts), length), dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, IGNORE_INDEX)
    for i, tokens in enumerate(prompts):
        ids[i, : len(tokens)], mask[i, : len(tokens)] = torch.tensor(list(tokens), dtype=torch.long), 1
        labels[i, 1 : len(tokens)] = ids[i, 1 : len(tokens)]  # every token but the first is scored
    batch = {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}
    scores = topk_at_targets(lm, batch, min(k, vocab_size(lm)))
    chosen, values, indices = scores.chosen.tolist(), scores.values.tolist(), scores.indices.tolist()
    out, start = [], 0
    for tokens in prompts:
        end = start + len(tokens) - 1
        top = [
            list(zip(i, v, strict=True)) for i, v in zip(indices[start:end], values[start:end], strict=True)
        ]
        out.append(([None, *chosen[start:end]], [None, *top]))
        start = end
    return out
