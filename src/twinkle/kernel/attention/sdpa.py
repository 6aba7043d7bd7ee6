"""The last backend of ``packed_attention``: SDPA once per sample, causal and without a mask.

No FLOPs go to pairs across samples and no ``(T, T)`` mask or score matrix is built (the ``T^2``
cost of a block-diagonal mask is what makes packing lose on long rows). A sample after a shared
prefix attends to the prefix keys and causally to its own."""

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

# Not cuDNN: it builds an execution plan for every new sequence length, and a packed row's samples
# have new lengths every batch, so every forward call pays for planning on the host (design
# note 13).
_GPU_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# Keys beyond which a sample after a shared prefix runs causal (see ``attend``): the CPU flash
# kernel's key block. Below it the masked call is as fast or faster.
CPU_KEY_BLOCK = 512

Call = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]  # query, key, value, shared prefix keys


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) mask by absolute position: ``(queries, keys)`` booleans."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= q_pos[:, None] - k_pos[None, :] < window
    return allowed


def zero_queries_first(query: torch.Tensor, count: int) -> torch.Tensor:
    """``query (B, H, L, D)`` after ``count`` zero queries: with the ``count`` prefix keys in front
    of the sample's own, a square causal call then gives each real query the prefix and its own
    past, as the bottom-right causal mask does."""
    if not count:
        return query
    return torch.cat([query.new_zeros(query.shape[0], query.shape[1], count, query.shape[3]), query], dim=2)


def attend(
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
        # keys. Their outputs are dropped, so they add nothing to any gradient (at 1000 queries
        # forward + backward takes about 0.73 of the masked call's time).
        out = F.scaled_dot_product_attention(
            zero_queries_first(query, shared), key, value, is_causal=True, scale=scaling, enable_gqa=gqa
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
    mask = window_mask(k_pos[keys - queries :], k_pos, window)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=gqa
    )


def sample_calls(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: list[int], prefix: int
) -> list[Call]:
    """One ``(q, k, v, shared)`` per sample of the row."""
    if not prefix:
        # one split per tensor (a single backward node) rather than a slice per sample
        return [
            (q, k, v, 0)
            for q, k, v in zip(*(t.split(lengths, dim=2) for t in (query, key, value)), strict=True)
        ]
    # The prefix and the first sample are contiguous: together one plain causal attention.
    queries = query.split([prefix + lengths[0], *lengths[1:]], dim=2)
    keys, values = (t.split([prefix, *lengths], dim=2) for t in (key, value))
    return [
        (
            q,
            torch.cat([keys[0], keys[i + 1]], dim=2),
            torch.cat([values[0], values[i + 1]], dim=2),
            0 if i == 0 else prefix,
        )
        for i, q in enumerate(queries)
    ]


def per_sample(
    calls: list[Call], window: int | None, dropout: float, scaling: float | None
) -> list[torch.Tensor]:
    """Each sample's SDPA output ``(1, H, L, D)``."""
    backends = sdpa_kernel(_GPU_BACKENDS) if calls and calls[0][0].device.type == "cuda" else nullcontext()
    with backends:
        return [attend(q, k, v, shared, window, dropout, scaling) for q, k, v, shared in calls]
