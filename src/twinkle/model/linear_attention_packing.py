"""Linear-attention layers (Gated DeltaNet) in a packed row: Qwen3.5, Qwen3.5-MoE and Qwen3-Next,
whose decoder layers mix linear attention with full attention.

A linear-attention layer carries a recurrent state, and a short causal convolution window, from
each token to the next; in a packed row they would run from one sample into the next.
transformers' PyTorch implementation of the scan takes no sample boundaries (it ignores the
``cu_seqlens`` that the CUDA kernels read), so here each such layer runs once per sample, on that
sample's span of the row, from an empty state: what the layer computes for the sample alone in
a padded batch (its right padding comes after the sample and changes nothing before it). The
full-attention layers between them take the row's segments as every packed family's do.

A prefix the row holds once for several samples (``twinkle.model.packing``) runs in front of
each of its samples' spans: a sample's state starts at its prefix's first token, as in the padded
batch. The prefix's own outputs are taken from its first sample's call (the layer is causal, so
what follows the prefix changes nothing in them). The linear-attention layers thus compute the
prefix once per sample, while every other part of the model (the full-attention layers, the MLPs
and experts, the head) computes it once."""

from typing import Any

import torch

# families with linear-attention layers among their decoder layers, and those layers' classes
HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
LINEAR_ATTENTION_CLASSES = ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen3NextGatedDeltaNet")
_WRAPPED = "_twinkle_per_sample"


def is_hybrid(lm: Any) -> bool:
    return getattr(lm.config, "model_type", None) in HYBRID_MODEL_TYPES


def _per_sample(forward: Any) -> Any:
    def run(hidden_states: torch.Tensor, *args: Any, twinkle_segments: Any = None, **kwargs: Any) -> Any:
        if twinkle_segments is None:
            return forward(hidden_states, *args, **kwargs)
        if twinkle_segments.length != hidden_states.shape[1]:
            raise ValueError(
                f"a packed row of {twinkle_segments.length} tokens reached a linear-attention layer "
                f"with {hidden_states.shape[1]}"
            )
        # a packed row holds no padding: no mask to apply (a traced forward would pass one of ones,
        # as long as the whole row, not as a sample's span)
        kwargs.pop("attention_mask", None)
        outs = []
        for start, _, part in twinkle_segments.parts():
            n = part.prefix
            prefix = hidden_states[:, start : start + n]
            for i, (a, b) in enumerate(part.spans):
                own = hidden_states[:, start + a : start + b]
                out = forward(torch.cat([prefix, own], dim=1) if n else own, *args, **kwargs)
                outs.append(out if i == 0 else out[:, n:])  # the prefix's outputs once
        return torch.cat(outs, dim=1)

    return run


def run_per_sample(lm: Any) -> None:
    """Make ``lm``'s linear-attention layers run each sample of a packed row on its own (a call
    without ``twinkle_segments`` is the layer's own forward); nothing for another family.
    Idempotent."""
    if not is_hybrid(lm):
        return
    for module in lm.modules():
        if type(module).__name__ in LINEAR_ATTENTION_CLASSES and not getattr(module, _WRAPPED, False):
            module.forward = _per_sample(module.forward)
            setattr(module, _WRAPPED, True)
