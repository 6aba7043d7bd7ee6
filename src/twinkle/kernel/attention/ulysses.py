"""Ulysses attention: each rank of a sequence-parallel group holds a share of the positions; the
attention of a layer all-to-alls q, k and v so that each rank holds every position for
``heads / size`` of the heads (``twinkle.distributed.sequence_parallel``), attends, and
all-to-alls the output back to its own positions.

Rotary embeddings are applied before the call, from each token's own (global) position id, so
the gathered sequence carries the same positions as the whole one. A packed row attends per
sample through ``twinkle.kernel.attention.packed`` with the whole row's ``Segments``; a padded
batch attends causally to the real tokens of its row (``key_mask``), within the model's sliding
window if it has one.

The function wraps the packed-row attention in Hugging Face's attention interface under
``PREFIX`` + its name; without ``twinkle_ulysses`` in the call it is exactly that function."""

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from twinkle.distributed.sequence_parallel import SequenceGroup, heads_to_seq, seq_to_heads
from twinkle.kernel.attention.packed import enable_segment_attention

PREFIX = "twinkle_ulysses:"


@dataclass(frozen=True)
class UlyssesCall:
    """What a forward under Ulysses passes its attention (keyword ``twinkle_ulysses``): the
    group, and for a padded batch each row's real tokens over the whole sequence, ``(B, L)``
    (None for a packed row, which the call's ``twinkle_segments`` describes)."""

    group: SequenceGroup
    key_mask: torch.Tensor | None = None


def masked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_mask: torch.Tensor,
    dropout: float,
    scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """Causal attention of ``query (B, H, L, D)`` over ``key``/``value (B, KV, L, D)`` restricted
    to the real tokens of each row (``key_mask (B, L)``) -> ``(B, L, H, D)``. A position always
    sees itself, so a pad with no real token before it gets a finite (unused) output."""
    length = query.shape[2]
    where = torch.arange(length, device=query.device)
    allowed = where[None, :] <= where[:, None]
    if sliding_window is not None:
        allowed &= where[None, :] > where[:, None] - sliding_window
    allowed = (allowed[None] & key_mask.bool()[:, None, :]) | torch.eye(
        length, dtype=torch.bool, device=query.device
    )
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=allowed[:, None], dropout_p=dropout, scale=scaling
    )
    return out.transpose(1, 2).contiguous()


def _dispatcher(inner_name: str) -> Any:
    def attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        dropout: float = 0.0,
        scaling: float | None = None,
        twinkle_ulysses: UlyssesCall | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        inner = ALL_ATTENTION_FUNCTIONS[inner_name]
        if twinkle_ulysses is None:
            return inner(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )
        group = twinkle_ulysses.group
        query, key, value = (seq_to_heads(t, group) for t in (query, key, value))
        if kwargs.get("twinkle_segments") is not None:
            # the local mask is of this rank's positions only; the segments describe the whole row
            out, _ = inner(module, query, key, value, None, dropout=dropout, scaling=scaling, **kwargs)
        else:
            window = kwargs.get("sliding_window")
            out = masked_attention(query, key, value, twinkle_ulysses.key_mask, dropout, scaling, window)
        return heads_to_seq(out, group), None

    return attention


def enable_ulysses_attention(config: Any) -> bool:
    """Route ``config``'s attention through the Ulysses exchange when a call passes
    ``twinkle_ulysses``, around the packed-row attention. False when the model's implementation
    cannot be wrapped (``eager``). Idempotent."""
    if not enable_segment_attention(config):
        return False
    current = config._attn_implementation
    if current.startswith(PREFIX):
        return True
    name = PREFIX + current
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _dispatcher(current))
        mask = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(current)
        if mask is not None:
            AttentionMaskInterface.register(name, mask)
    config._attn_implementation = name
    return True
