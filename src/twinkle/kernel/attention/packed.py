"""Call op ``packed_attention``: attention over a packed row, each sample on its own.

A packed batch is one row holding every sample end to end (see ``twinkle.model.packing``).
``Segments`` says where each sample lies; a sample sees only its own earlier tokens and, where
samples share a prefix held once in the row (at its start, or before each group of samples), the
prefix. ``segment_attention``
walks the op's chain (``DEFAULT_CALL_CHAINS``): the C kernel (``native``), the flash calls with
a pooled backward (``pooled``), batched products (``batched``), SDPA per sample (``sdpa``); each
backend takes the rows it is built for and the last takes every row (a row of groups block by
block, each through the chain again).

The function is registered with Hugging Face's attention interface under a name derived from
the model's own implementation; without ``twinkle_segments`` in the call it is exactly that
implementation (evaluation of padded batches, generation)."""

from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from twinkle.kernel import registry
from twinkle.kernel.attention import batched, native, pooled, sdpa

PREFIX = "twinkle_segments:"
OP = "packed_attention"
_CPU_UPCAST = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Segments:
    """Samples in a packed row: ``spans[i] = (start, end)`` of sample ``i``'s own tokens; the
    first ``prefix`` tokens of the row, if any, are a prefix every sample continues. Or, where
    groups of samples each continue a prefix of their own, ``blocks``: the row as consecutive
    ``(start, prefix, samples)``, a prefix of ``prefix`` tokens at ``start`` then the next
    ``samples`` spans, each continuing it (``prefix`` is then 0)."""

    spans: tuple[tuple[int, int], ...]
    prefix: int = 0
    blocks: tuple[tuple[int, int, int], ...] = ()

    @property
    def length(self) -> int:
        return self.spans[-1][1] if self.spans else self.prefix

    def prefixes(self) -> list[tuple[int, int]]:
        """``(start, length)`` of each prefix the row holds."""
        if not self.blocks:
            return [(0, self.prefix)] if self.prefix else []
        return [(start, n) for start, n, _ in self.blocks if n]

    def contexts(self) -> list[tuple[int, int]]:
        """``(start, length)`` of the prefix each sample continues (length 0: none)."""
        if not self.blocks:
            return [(0, self.prefix)] * len(self.spans)
        return [(start, n) for start, n, samples in self.blocks for _ in range(samples)]

    def parts(self) -> list[tuple[int, int, "Segments"]]:
        """The row as independent parts ``(start, end, segments)``, positions within a part
        counted from its start: each block, or the whole row."""
        if not self.blocks:
            return [(0, self.length, self)]
        parts, first = [], 0
        for start, n, samples in self.blocks:
            own = self.spans[first : first + samples]
            first += samples
            end = own[-1][1]
            parts.append((start, end, Segments(tuple((a - start, b - start) for a, b in own), n)))
        return parts


@dataclass(frozen=True)
class Row:
    """One call of the op: ``query (1, H, T, D)``, ``key``/``value (1, KV, T, D)``."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    segments: Segments
    dropout: float
    scaling: float | None
    window: int | None

    @property
    def lengths(self) -> list[int]:
        return [end - start for start, end in self.segments.spans]


def _native(row: Row) -> torch.Tensor | None:
    q, k, segments = row.query, row.key, row.segments
    if not native.usable(q, k, segments.spans, row.dropout, row.window):
        return None
    return native.native_attention(q, k, row.value, segments, row.scaling)


def _pooled(row: Row) -> torch.Tensor | None:
    if row.segments.blocks:
        return None
    work = batched.flash_pairs(row.lengths, row.segments.prefix)
    if row.window is not None or row.dropout or not pooled.usable(row.query, work):
        return None
    calls = sdpa.sample_calls(row.query, row.key, row.value, row.lengths, row.segments.prefix)
    return _joined(pooled.pooled_rows(calls, row.scaling))


def _batched(row: Row) -> torch.Tensor | None:
    if row.segments.blocks or not batched.usable(row.query, row.key, row.segments, row.dropout, row.window):
        return None
    plan = batched.plan_for(row.segments, row.query, row.key)
    return (
        None if plan is None else batched.batched_attention(row.query, row.key, row.value, plan, row.scaling)
    )


def _sdpa(row: Row) -> torch.Tensor:
    if row.segments.blocks:  # each block a row of its own, through the whole chain
        return torch.cat(
            [
                segment_attention(
                    *(t[:, :, start:end] for t in (row.query, row.key, row.value)),
                    part,
                    row.dropout,
                    row.scaling,
                    row.window,
                )
                for start, end, part in row.segments.parts()
            ],
            dim=1,
        )
    calls = sdpa.sample_calls(row.query, row.key, row.value, row.lengths, row.segments.prefix)
    return _joined(sdpa.per_sample(calls, row.window, row.dropout, row.scaling))


def _joined(outputs: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


_RUN = {"native": _native, "pooled": _pooled, "batched": _batched, "sdpa": _sdpa}
registry.register_call(OP, "sdpa", lambda: True, "nothing", plain=True)


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
        # torch's CPU flash kernel in bf16 takes about twice as long as in fp32 (forward +
        # backward, short samples and long): run the row in fp32, round the output once
        out = segment_attention(
            query.float(), key.float(), value.float(), segments, dropout, scaling, sliding_window
        )
        return out.to(query.dtype)
    if query.shape[0] != 1 or query.shape[2] != segments.length:
        raise ValueError(
            f"packed attention expects one row of {segments.length} tokens, got {tuple(query.shape)}"
        )
    row = Row(query, key, value, segments, dropout, scaling, sliding_window)
    # each backend checks the row first (cheap), then the registry: a CPU-only backend is never
    # built where no row reaches it; sdpa, the chain's last, takes every row
    return registry.dispatch(OP, _RUN, row)


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
    if PREFIX in current:  # this wrapper, alone or inside another (``ulysses``)
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
