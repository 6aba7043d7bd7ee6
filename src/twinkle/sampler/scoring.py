"""``SamplingParams(prompt_logprobs=k)``: the model's log-probability of each prompt token given
the tokens before it, and the ``k`` most likely tokens at each position, from one forward pass
over the prompt (temperature 1, as the log-probabilities of sampled tokens)."""

from typing import Any

import torch

from twinkle.model.vision_positions import token_type_inputs

PromptScores = tuple[list[float | None], list[list[tuple[int, float]] | None]]


@torch.no_grad()
def score_prompt(
    lm: Any, ids: list[int], k: int, vision: dict[str, torch.Tensor] | None = None
) -> PromptScores:
    """``(prompt_logprobs, topk_prompt_logprobs)`` of one prompt; both start with None (nothing
    predicts the first token). ``vision``: the prompt's images (``pixel_values``,
    ``image_grid_thw``), with which the model works out its M-RoPE positions."""
    device = next(lm.parameters()).device
    tokens = torch.tensor([ids], device=device)
    images = {}
    if vision is not None:
        images = {key: value.to(device) for key, value in vision.items()}
        images.update(token_type_inputs(lm, tokens))
    logits = lm(input_ids=tokens, use_cache=False, **images).logits[0, :-1].float()
    logps = torch.log_softmax(logits, dim=-1)
    chosen = logps.gather(-1, tokens[0, 1:, None]).squeeze(-1).tolist()
    if k > 0:
        values, indices = logps.topk(min(k, logps.shape[-1]), dim=-1)
        top = [list(zip(i, v, strict=True)) for i, v in zip(indices.tolist(), values.tolist(), strict=True)]
    else:
        top = [[] for _ in chosen]
    return [None, *chosen], [None, *top]
