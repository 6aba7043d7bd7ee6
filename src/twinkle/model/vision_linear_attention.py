"""Qwen3.5's linear-attention layers (Gated DeltaNet) in a packed row of image samples
(``twinkle.model.vision_packing``).

A linear-attention layer carries a recurrent state, and a short causal convolution window, from
each token to the next; in a packed row they would run from one sample into the next.
transformers' PyTorch implementation of the scan takes no sample boundaries (it ignores the
``cu_seqlens`` that the CUDA kernels read), so here each such layer runs once per sample, on that
sample's span of the row, from an empty state: what the layer computes for the sample alone in
a padded batch (its right padding comes after the sample and changes nothing before it). The
full-attention layers between them take the row's segments as every packed family's do."""

from typing import Any

import torch

from twinkle.utils.errors import UserError

HYBRID_VISION_TYPES = ("qwen3_5",)  # families with linear-attention layers among their decoder layers
LINEAR_ATTENTION_CLASSES = ("Qwen3_5GatedDeltaNet",)
_WRAPPED = "_twinkle_per_sample"


def _per_sample(forward: Any) -> Any:
    def run(hidden_states: torch.Tensor, *args: Any, twinkle_segments: Any = None, **kwargs: Any) -> Any:
        if twinkle_segments is None:
            return forward(hidden_states, *args, **kwargs)
        spans = twinkle_segments.spans
        covered = [end - start for start, end in spans]
        if twinkle_segments.prefix or twinkle_segments.blocks or sum(covered) != hidden_states.shape[1]:
            raise UserError(
                "a packed row with a shared prefix reached a linear-attention layer; Qwen3.5's image rows "
                "pack without one (share_prefix=False)"
            )
        outs = [forward(hidden_states[:, start:end], *args, **kwargs) for start, end in spans]
        return torch.cat(outs, dim=1)

    return run


def run_per_sample(lm: Any) -> None:
    """Make ``lm``'s linear-attention layers run each sample of a packed row on its own (a call
    without ``twinkle_segments`` is the layer's own forward); nothing for another family.
    Idempotent."""
    if getattr(lm.config, "model_type", None) not in HYBRID_VISION_TYPES:
        return
    for module in lm.modules():
        if type(module).__name__ in LINEAR_ATTENTION_CLASSES and not getattr(module, _WRAPPED, False):
            module.forward = _per_sample(module.forward)
            setattr(module, _WRAPPED, True)
