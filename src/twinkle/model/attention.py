"""Attention over a packed row, one sample at a time.

A packed batch is one row holding every sample end to end (see ``twinkle.model.packing``).
``Segments`` says where each sample lies; ``segment_attention`` runs SDPA once per sample, causal
and without a mask, so no FLOPs go to pairs across samples and no ``(T, T)`` mask or score
matrix is built (the ``T^2`` cost of a block-diagonal mask is what made packing lose on long
rows). Samples may share a prefix held once at the start of the row: a sample's queries then
attend to the prefix keys and causally to their own.

The function is registered with Hugging Face's attention interface under a name derived from
the model's own implementation; without ``twinkle_segments`` in the call it is exactly that
implementation (evaluation of padded batches, generation)."""

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from twinkle.model import batched_attention, cpu_attention, native_attention

PREFIX = "twinkle_segments:"
_CPU_UPCAST = (torch.bfloat16, torch.float16)
# Not cuDNN: it builds an execution plan for every new sequence length, and a packed row's samples
# have new lengths every batch. Measured on an H200 (torch 2.11, Qwen2.5-0.5B shape, batch 4):
# 2.85 ms of CPU per forward call and 2.4 ms per backward, against ~30 ms of GPU work per step.
_GPU_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# Keys beyond which a sample after a shared prefix runs causal (see ``_attend``): the CPU flash
# kernel's key block. Below it the masked call is as fast or faster (measured: 400 queries after
# 14 prefix keys 12.5 ms both ways, 480: 17.9 masked vs 18.8; 520: 22.2 vs 19.7).
CPU_KEY_BLOCK = 512


@dataclass(frozen=True)
class Segments:
    """Samples in a packed row: ``spans[i] = (start, end)`` of sample ``i``'s own tokens; the
    first ``prefix`` tokens of the row, if any, are a prefix every sample continues."""

    spans: tuple[tuple[int, int], ...]
    prefix: int = 0

    @property
    def length(self) -> int:
        return self.spans[-1][1] if self.spans else self.prefix


def _window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) mask by absolute position: ``(queries, keys)`` booleans."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= q_pos[:, None] - k_pos[None, :] < window
    return allowed


def _zero_queries_first(query: torch.Tensor, count: int) -> torch.Tensor:
    """``query (B, H, L, D)`` after ``count`` zero queries: with the ``count`` prefix keys in front
    of the sample's own, a square causal call then gives each real query the prefix and its own
    past, as the bottom-right causal mask does."""
    if not count:
        return query
    return torch.cat([query.new_zeros(query.shape[0], query.shape[1], count, query.shape[3]), query], dim=2)


def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    shared: int,
    window: int | None,
    dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    """SDPA of ``query`` (the last ``L`` keys' positions) over ``key``: the first ``shared`` keys
    are a prefix all queries see, the rest are causal with the queries."""
    queries, keys = query.shape[2], key.shape[2]
    gqa = query.shape[1] != key.shape[1]
    if shared == 0 and (window is None or keys <= window):
        return F.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout, is_causal=queries > 1, scale=scaling, enable_gqa=gqa
        )
    if window is None and query.device.type == "cpu" and keys > CPU_KEY_BLOCK and not dropout:
        # torch's CPU flash kernel works through the keys in blocks of 512 and skips the blocks
        # above the diagonal only for ``is_causal``; with a mask it computes every block. So
        # once there is more than one block, run the square causal call instead: ``shared``
        # zero queries in front make query ``i`` see exactly the prefix and its own first ``i``
        # keys. Their outputs are dropped, so they add nothing to any gradient (measured:
        # 28.8 -> 24.6 ms forward + backward at 600 queries, 69.3 -> 50.8 at 1000).
        out = F.scaled_dot_product_attention(
            _zero_queries_first(query, shared), key, value, is_causal=True, scale=scaling, enable_gqa=gqa
        )
        return out[:, :, shared:]
    if window is None and query.device.type == "cuda":
        # the queries are the last keys: causal aligned to the bottom right, which flash and
        # efficient attention take without a mask
        mask = causal_lower_right(queries, keys)
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=gqa
        )
    k_pos = torch.arange(keys, device=query.device)
    mask = _window_mask(k_pos[keys - queries :], k_pos, window)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=gqa
    )


def segment_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: Segments,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """``query (1, H, T, D)``, ``key``/``value (1, KV, T, D)`` -> ``(1, T, H, D)``."""
    if query.device.type == "cpu" and query.dtype in _CPU_UPCAST:
        # torch's CPU flash kernel in bf16 takes ~2x as long as in fp32 on a sample of ~50
        # tokens (forward + backward; even at ~700): run the row in fp32, round the output once
        out = segment_attention(
            query.float(), key.float(), value.float(), segments, dropout, scaling, sliding_window
        )
        return out.to(query.dtype)
    if query.shape[0] != 1 or query.shape[2] != segments.length:
        raise ValueError(
            f"packed attention expects one row of {segments.length} tokens, got {tuple(query.shape)}"
        )
    p = segments.prefix
    if native_attention.usable(query, key, segments.spans, dropout, sliding_window):
        return native_attention.native_attention(query, key, value, segments.spans, p, scaling)
    lengths = [end - start for start, end in segments.spans]
    work = batched_attention.flash_pairs(lengths, p)
    pooled = sliding_window is None and not dropout and cpu_attention.usable(query, work)
    if not pooled and batched_attention.usable(query, key, segments, dropout, sliding_window):
        plan = batched_attention.plan_for(segments, query, key)
        if plan is not None:
            return batched_attention.batched_attention(query, key, value, plan, scaling)
    if not p:
        # one split per tensor (a single backward node) rather than a slice per sample
        calls = [
            (q, k, v, 0)
            for q, k, v in zip(*(t.split(lengths, dim=2) for t in (query, key, value)), strict=True)
        ]
    else:
        # The prefix and the first sample are contiguous: together one plain causal attention.
        queries = query.split([p + lengths[0], *lengths[1:]], dim=2)
        keys, values = (t.split([p, *lengths], dim=2) for t in (key, value))
        calls = [
            (
                q,
                torch.cat([keys[0], keys[i + 1]], dim=2),
                torch.cat([values[0], values[i + 1]], dim=2),
                0 if i == 0 else p,
            )
            for i, q in enumerate(queries)
        ]
    if pooled:
        outputs = _pooled(calls, scaling)
    else:
        backends = sdpa_kernel(_GPU_BACKENDS) if query.device.type == "cuda" else nullcontext()
        with backends:
            outputs = [
                _attend(q, k, v, shared, sliding_window, dropout, scaling) for q, k, v, shared in calls
            ]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


def _pooled(
    calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]], scaling: float | None
) -> list[torch.Tensor]:
    """Every sample as a square causal call (zero queries stand in for a shared prefix's, as in
    ``_attend``; here also below one key block, where the masked call would be a little faster,
    since only rows with long samples come here), backward spread over the cores
    (``twinkle.model.cpu_attention``)."""
    triples = [(_zero_queries_first(q, shared), k, v) for q, k, v, shared in calls]
    outputs = cpu_attention.pooled_causal_attention(triples, scaling)
    return [out[:, :, shared:] for out, (_, _, _, shared) in zip(outputs, calls, strict=True)]


def _dispatcher(base_name: str) -> Any:
    def attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        dropout: float = 0.0,
        scaling: float | None = None,
        twinkle_segments: Segments | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if twinkle_segments is None:
            base = ALL_ATTENTION_FUNCTIONS[base_name]
            return base(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        out = segment_attention(
            query, key, value, twinkle_segments, dropout, scaling, kwargs.get("sliding_window")
        )
        return out, None

    return attention


def enable_segment_attention(config: Any) -> bool:
    """Route ``config``'s attention through ``segment_attention`` when a call passes
    ``twinkle_segments``. False when the model's implementation cannot be wrapped (``eager``:
    each family has its own). Idempotent."""
    current = config._attn_implementation or "sdpa"
    if current.startswith(PREFIX):
        return True
    if current not in ALL_ATTENTION_FUNCTIONS:
        return False
    name = PREFIX + current
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _dispatcher(current))
        mask = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(current)
        if mask is not None:
            AttentionMaskInterface.register(name, mask)
    config._attn_implementation = name
    return True
