"""Attention of a packed row's short samples as a few batched products, on the CPU.

torch's CPU flash kernel has a fixed cost per call, whatever the sizes, and for a short sample
that cost is most of the call (at a head size of 4 a call takes more than half its time at 64).
A row of a few short samples pays it once per sample in every layer. Here the whole row is one
padded batch, and its attention two batched products and a softmax forward, four products and the
softmax's backward in backward, all in one autograd node.

Layout (a ``Plan``, made once per row and reused by every layer): the samples are grouped into
blocks of equal size, first-fit by decreasing length, at the block size that leaves the least
padding (``layout``); one block also carries the shared prefix's own queries. A block's keys are
the prefix and its samples' tokens, its queries its samples' tokens; a query sees the prefix and
its own sample's earlier tokens (a mask by sample and position). The query heads sharing a
key/value head are stacked as rows of one product (no repeated keys). Each of q, k, v (and in
backward the output's gradient) reaches the blocks' layout in one gather of head-sized rows, and
each result leaves it in one gather or one indexed sum, which is faster than gathering
positions and then permuting heads. Masked and padded key slots get
-inf, so their probability and gradients are exactly zero; padded query slots see key 0 (a
finite softmax), their probabilities are then zeroed, so they have no output and pass on no
gradient, whatever their gathered output gradient holds.
Results equal the flash kernel's up to summation order (~3e-6 on unit-scale inputs).

Padding is the price: every block is as long as the longest, and its scores span all its keys.
So a row takes this path only where a cost model says it pays (``pays``): a fixed cost plus a
cost per query-key pair for each path (padded pairs for this one, a cost per call for the
per-sample calls), fitted by ``bench/micro/attention_bench.py --fit`` on random rows of short
samples, forward + backward. Rows of long samples keep the calls (``MAX_QUERIES``). Design
note 17."""

from dataclasses import dataclass

import torch

from twinkle.kernel import registry, switches

# the cost model (us, forward + backward; pair costs at heads * head_dim = 576, scaled by it)
FIXED_US, PAIR_US = 351.0, 0.084  # batched: once a row, per padded query-key pair
CALL_US, CALL_PAIR_US = 273.0, 0.096  # per-sample flash calls: per call, per query-key pair
MAX_QUERIES = 192  # longer blocks than the model was fitted on keep the flash calls
LAYOUT_SIZES = 8  # block sizes ``layout`` tries at most (each a first-fit pass over the samples)


@dataclass(frozen=True)
class Plan:
    """Where each block's queries and keys sit in the row (``*_index``), where each row position's
    output sits in the padded blocks (``out_index``) and the additive mask, shaped as the scores."""

    blocks: int
    group: int  # query heads per key/value head
    queries: int  # padded queries per block
    keys: int  # padded keys per block
    q_index: torch.Tensor  # (blocks * queries,) row positions; pads point at 0
    k_index: torch.Tensor  # (blocks * keys,)
    out_index: torch.Tensor  # (row length,) slot of each position in the padded queries
    bias: torch.Tensor  # (blocks * kv_heads, group * queries, keys): 0 or -inf
    keep: torch.Tensor  # (blocks * kv_heads, group * queries, 1): 1 for a real query, 0 for a pad
    # the same positions as single rows of head_dim values, in the blocks' order:
    q_rows: torch.Tensor  # (block, kv head, group member, query) -> row of the queries (T * heads)
    kv_rows: torch.Tensor  # (block, kv head, key) -> row of the keys (T * kv_heads)
    out_rows: torch.Tensor  # (position, head) -> row of the blocks' outputs


def layout(lengths: list[int], prefix: int) -> tuple[list[list[int]], int]:
    """The samples (by index) in each block, and which block carries the prefix's queries (-1
    without a prefix): first-fit decreasing at the block size, of the longest sample alone or
    paired with another, that leaves the fewest padded query-key pairs."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    longest = lengths[order[0]]
    sizes = sorted({longest, *(longest + n for n in lengths)})
    step = max(1, len(sizes) // LAYOUT_SIZES)  # a big batch tries a spread of sizes, not all
    best = None
    for size in sizes[::step]:
        blocks: list[list[int]] = []
        loads: list[int] = []
        for i in order:
            fit = next((b for b, load in enumerate(loads) if load + lengths[i] <= size), None)
            if fit is None:
                blocks.append([i])
                loads.append(lengths[i])
            else:
                blocks[fit].append(i)
                loads[fit] += lengths[i]
        carrier = min(range(len(loads)), key=loads.__getitem__) if prefix else -1
        queries = max(load + (prefix if b == carrier else 0) for b, load in enumerate(loads))
        padded = len(blocks) * queries * (prefix + max(loads))
        if best is None or padded < best[0]:
            best = (padded, blocks, carrier)
    return best[1], best[2]


def padded_size(lengths: list[int], prefix: int) -> tuple[int, int]:
    """Query-key pairs the batched products compute for this row, padding included, and the
    queries of a block."""
    blocks, carrier = layout(lengths, prefix)
    loads = [sum(lengths[i] for i in block) for block in blocks]
    queries = max(load + (prefix if b == carrier else 0) for b, load in enumerate(loads))
    return len(blocks) * queries * (prefix + max(loads)), queries


def flash_pairs(lengths: list[int], prefix: int) -> int:
    """Query-key pairs of the per-sample flash calls: the prefix rides with the first sample."""
    return (prefix + lengths[0]) ** 2 + sum(n * (prefix + n) for n in lengths[1:]) if lengths else 0


def pays(spans: tuple[tuple[int, int], ...], prefix: int, width: int) -> bool:
    """Whether the cost model expects this row (``width`` = heads * head_dim) to run faster as
    batched products than as one flash call per sample."""
    if switches.value("TWINKLE_BATCHED_ATTENTION") == "always":
        return True
    lengths = [end - start for start, end in spans]
    if max(lengths) > MAX_QUERIES:  # no layout can keep its blocks short enough
        return False
    padded, queries = padded_size(lengths, prefix)
    if queries > MAX_QUERIES:
        return False
    pairs = flash_pairs(lengths, prefix)
    scale = width / 576
    return FIXED_US + PAIR_US * scale * padded < CALL_US * len(spans) + CALL_PAIR_US * scale * pairs


def make_plan(
    spans: tuple[tuple[int, int], ...], prefix: int, heads: int, kv_heads: int, device: torch.device
) -> Plan:
    blocks, carrier = layout([end - start for start, end in spans], prefix)
    members = []  # per block: (key positions, key samples, query positions, query samples)
    for b, block in enumerate(blocks):
        own = [torch.arange(*spans[i]) for i in block]
        owner = [torch.full((len(t),), i) for i, t in zip(block, own, strict=True)]
        keys, key_owner = (
            torch.cat([torch.arange(prefix), *own]),
            torch.cat([torch.full((prefix,), -1), *owner]),
        )
        first_query = 0 if b == carrier else prefix
        members.append((keys, key_owner, keys[first_query:], key_owner[first_query:]))
    queries = max(len(m[2]) for m in members)
    keys = max(len(m[0]) for m in members)
    q_index = torch.zeros(len(blocks), queries, dtype=torch.long)
    k_index = torch.zeros(len(blocks), keys, dtype=torch.long)
    out_index = torch.empty(spans[-1][1], dtype=torch.long)
    allowed = torch.zeros(len(blocks), queries, keys, dtype=torch.bool)
    for b, (k_pos, k_owner, q_pos, q_owner) in enumerate(members):
        k_index[b, : len(k_pos)] = k_pos
        q_index[b, : len(q_pos)] = q_pos
        out_index[q_pos] = b * queries + torch.arange(len(q_pos))
        # the prefix and the query's own sample, up to the query's position
        seen = (k_pos[None, :] <= q_pos[:, None]) & (
            (k_owner[None, :] == -1) | (k_owner[None, :] == q_owner[:, None])
        )
        allowed[b, : len(q_pos), : len(k_pos)] = seen
        allowed[b, len(q_pos) :, 0] = True  # padded queries: a finite softmax, output dropped
    group = heads // kv_heads
    bias = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
    bias = bias[:, None, None].expand(-1, kv_heads, group, -1, -1)
    real = torch.zeros(len(blocks), queries)
    for b, member in enumerate(members):
        real[b, : len(member[2])] = 1.0
    keep = real[:, None, None, :, None].expand(-1, kv_heads, group, -1, -1)
    head = torch.arange(heads).view(1, kv_heads, group, 1)
    kv_head = torch.arange(kv_heads).view(1, kv_heads, 1)
    slot_block, slot = out_index // queries, out_index % queries
    out_rows = (
        (slot_block[:, None] * heads + torch.arange(heads)[None, :]) * queries + slot[:, None]
    ).flatten()
    return Plan(
        blocks=len(blocks),
        group=group,
        queries=queries,
        keys=keys,
        q_index=q_index.flatten().to(device),
        k_index=k_index.flatten().to(device),
        out_index=out_index.to(device),
        bias=bias.reshape(len(blocks) * kv_heads, group * queries, keys).contiguous().to(device),
        keep=keep.reshape(len(blocks) * kv_heads, group * queries, 1).contiguous().to(device),
        q_rows=(q_index[:, None, None, :] * heads + head).flatten().to(device),
        kv_rows=(k_index[:, None, :] * kv_heads + kv_head).flatten().to(device),
        out_rows=out_rows.to(device),
    )


def _gather(rows: torch.Tensor, index: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of ``head_dim`` values, picked by ``index`` from ``rows`` seen as ``(-1, head_dim)``."""
    return rows.reshape(-1, head_dim).index_select(0, index)


def _scatter_add(blocks: torch.Tensor, index: torch.Tensor, length: int, width: int) -> torch.Tensor:
    """``_gather``'s adjoint: each block row summed into its row position (a key of the prefix
    sits in every block), ``(length, width)``."""
    head_dim = blocks.shape[-1]
    out = blocks.new_zeros(length * width // head_dim, head_dim)
    return out.index_add_(0, index, blocks.reshape(-1, head_dim)).view(length, width)


class _BatchedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, plan, kv_heads, scale):
        # query (length, heads * D), key / value (length, kv_heads * D); each gathered straight
        # into the blocks' layout by one index (see ``Plan``)
        head_dim = query.shape[1] // (kv_heads * plan.group)
        q = _gather(query, plan.q_rows, head_dim).view(
            plan.blocks * kv_heads, plan.group * plan.queries, head_dim
        )
        k = _gather(key, plan.kv_rows, head_dim).view(plan.blocks * kv_heads, plan.keys, head_dim)
        v = _gather(value, plan.kv_rows, head_dim).view(plan.blocks * kv_heads, plan.keys, head_dim)
        probs = torch.softmax(torch.baddbmm(plan.bias, q, k.transpose(1, 2), alpha=scale), dim=-1)
        probs.mul_(plan.keep)  # padded queries: no output and, in backward, no gradient
        out = _gather(torch.bmm(probs, v), plan.out_rows, head_dim).view(query.shape)
        ctx.save_for_backward(q, k, v, probs)
        ctx.plan, ctx.kv_heads, ctx.scale = plan, kv_heads, scale
        ctx.shapes = (query.shape, key.shape)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, probs = ctx.saved_tensors
        plan, (q_shape, kv_shape) = ctx.plan, ctx.shapes
        head_dim = q.shape[-1]
        # a padded query's row of ``probs`` is zero, so whatever its slot gathers is ignored
        g = _gather(grad_out, plan.q_rows, head_dim).view(q.shape)
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        grad_q = grad_k = grad_v = None
        if need_v:
            grad_v = _scatter_add(torch.bmm(probs.transpose(1, 2), g), plan.kv_rows, *kv_shape)
        if need_q or need_k:
            grad_probs = torch.bmm(g, v.transpose(1, 2))
            grad_scores = torch.ops.aten._softmax_backward_data(grad_probs, probs, -1, probs.dtype)
            grad_scores.mul_(ctx.scale)
            if need_q:
                grad_q = _gather(torch.bmm(grad_scores, k), plan.out_rows, head_dim).view(q_shape)
            if need_k:
                grad_k = _scatter_add(torch.bmm(grad_scores.transpose(1, 2), q), plan.kv_rows, *kv_shape)
        return grad_q, grad_k, grad_v, None, None, None


_plans: dict[tuple, Plan | None] = {}
PLANS_KEPT = 4  # rows whose plan is kept (a step reuses one row's across its layers)


def plan_for(segments, query: torch.Tensor, key: torch.Tensor) -> Plan | None:
    """The row's plan, or None where the per-sample calls are expected to be faster; decided on
    the row's first layer and reused by the others."""
    heads, kv_heads = query.shape[1], key.shape[1]
    choice = switches.value("TWINKLE_BATCHED_ATTENTION")
    cache_key = (segments.spans, segments.prefix, heads, kv_heads, query.shape[-1], query.device, choice)
    if cache_key not in _plans:
        if len(_plans) >= PLANS_KEPT:
            _plans.clear()
        chosen = pays(segments.spans, segments.prefix, heads * query.shape[-1])
        plan = make_plan(segments.spans, segments.prefix, heads, kv_heads, query.device) if chosen else None
        _plans[cache_key] = plan
    return _plans[cache_key]


def usable(query: torch.Tensor, key: torch.Tensor, segments, dropout: float, window: int | None) -> bool:
    """fp32 on the CPU, no dropout or window, whole groups of query heads."""
    return (
        query.device.type == "cpu"
        and query.dtype == torch.float32
        and not dropout
        and window is None
        and bool(segments.spans)
        and query.shape[1] % key.shape[1] == 0
        and registry.enabled("packed_attention", "batched")
    )


def batched_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: Plan, scale: float | None
) -> torch.Tensor:
    """``query (1, H, T, D)``, ``key``/``value (1, KV, T, D)`` -> ``(1, T, H, D)``, each sample
    (and the shared prefix) causal, as ``segment_attention``."""
    _, heads, length, head_dim = query.shape
    kv_heads = key.shape[1]
    rows = [t.transpose(1, 2).reshape(length, -1) for t in (query, key, value)]
    scale = head_dim**-0.5 if scale is None else scale
    out = _BatchedAttention.apply(*rows, plan, kv_heads, float(scale))
    return out.view(1, length, heads, head_dim)


registry.register_call("packed_attention", "batched", lambda: True, "nothing")
