"""Padding-free batches: the samples of a right-padded batch laid end to end in one row.

Each position carries its own target (the next token's label), so nothing crosses a sample
border. Three things are left out of the row because no loss depends on them:

- padding;
- each sample's tail after its last position with a target (causal attention: later tokens
  influence nothing that is scored), unless the step adds the MoE router's load-balancing loss,
  which counts every routed token (``keep_tails``);
- all but one copy of a prefix every sample shares (system prompt, chat markup): the row holds
  it once and every sample attends to it. Where consecutive samples share a longer prefix (the
  two sides of a preference pair, the completions of one prompt), or run through different
  adapters, each such group holds its own prefix once, before its samples. Where a prefix holds
  targets too (the same in every sample: a Tinker datum scores every position), its positions
  are scored once in the row and ``gather`` lists, for each scored position of the padded batch
  in row-major order, where it lies in the row, so a loss still sees every sample's targets.

``twinkle.kernel.attention.packed`` runs attention per sample, and in the hybrid families (Qwen3.5,
Qwen3.5-MoE, Qwen3-Next) each linear-attention layer runs each sample's span, after its prefix, on
its own (``twinkle.model.linear_attention_packing``), so the loss and gradients equal those of the
padded batch up to summation order."""

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from twinkle.kernel.attention.packed import Segments, enable_segment_attention
from twinkle.model.linear_attention_packing import is_hybrid, run_per_sample
from twinkle.template.base import IGNORE_INDEX

# Decoder families that mix tokens only in attention (through Hugging Face's attention
# interface) and take positions from ``position_ids``.
PACKABLE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
MIN_SHARED_PREFIX = 4  # shorter shared prefixes are not worth an extra attention call per sample


def shifted_targets(labels: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``(B, L)`` labels aligned with the inputs -> the target of each position (its next label).

    A position has a target only if it and the next one are real tokens: a pad is never predicted
    and never predicts, whatever label a hand-made batch gave it."""
    ignore = torch.full_like(labels[:, :1], IGNORE_INDEX)
    real = attention_mask.bool()
    both = torch.cat([real[:, :-1] & real[:, 1:], torch.zeros_like(real[:, :1])], dim=1)
    return torch.cat([labels[:, 1:], ignore], dim=1).masked_fill(~both, IGNORE_INDEX)


def can_pack(lm: Any, share_prefix: bool | Sequence[Hashable] = True) -> bool:
    """Whether ``lm`` runs ``pack``'s rows (``share_prefix`` as ``pack`` takes it): a family of
    ``PACKABLE_MODEL_TYPES``, or a hybrid one whose linear-attention layers are then made to run
    per sample (``linear_attention_packing``), with attention that takes segments.

    A hybrid family packs rows of one adapter only: rows of several adapters (a key per row) run
    padded, because their LoRA layers place each adapter by its tokens' places in the whole row
    (``twinkle.model.lora_modes``), and a linear-attention layer's LoRA layers see one sample's
    span at a time."""
    if is_hybrid(lm):
        if not isinstance(share_prefix, bool):
            return False
        run_per_sample(lm)
    elif getattr(lm.config, "model_type", None) not in PACKABLE_MODEL_TYPES:
        return False
    return enable_segment_attention(lm.config)


def scored_lengths(targets: torch.Tensor) -> list[int]:
    """How much of each row a packed row keeps: up to its last position with a target (0 for a
    row without one, which is left out)."""
    scored = targets != IGNORE_INDEX
    return torch.where(scored.any(1), targets.shape[1] - scored.flip(1).int().argmax(1), 0).tolist()


def _common_prefix(rows: list[torch.Tensor]) -> int:
    limit = min(len(r) for r in rows)
    heads = torch.stack([r[:limit] for r in rows])  # on the rows' device, like everything here
    same = (heads == heads[:1]).all(0)
    return int(same.int().cumprod(0).sum())


def row_groups(rows: list[int], keys: Sequence[Hashable]) -> list[list[int]]:
    """The kept rows in runs of consecutive rows with equal keys (one key per batch row)."""
    groups: list[list[int]] = []
    for i in rows:
        if groups and keys[groups[-1][-1]] == keys[i]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _shared(ids: torch.Tensor, targets: torch.Tensor, keep: list[int], group: list[int]) -> int:
    """The prefix ``group``'s rows hold once: the tokens and targets they all start with, short of
    each row's last kept token; 0 below ``MIN_SHARED_PREFIX`` or for one row."""
    if len(group) < 2:
        return 0
    shared = min(
        _common_prefix([ids[i, : keep[i]] for i in group]),
        _common_prefix([targets[i, : keep[i]] for i in group]),
        min(keep[i] for i in group) - 1,
    )
    return shared if shared >= MIN_SHARED_PREFIX else 0


def _prefix_groups(
    ids: torch.Tensor, targets: torch.Tensor, keep: list[int], rows: list[int]
) -> list[list[int]]:
    """The kept rows cut into runs of consecutive rows, each holding the prefix its rows share
    once, cut where that leaves the most tokens out of the row: one run of every row where all
    share just the system prompt and chat markup, a run per pair or per prompt where consecutive
    rows share a longer one (a preference pair's prompt, a prompt's sampled completions). Exact,
    by dynamic programming over the cut points: quadratic in the rows, linear in their length."""
    n = len(rows)
    # common[a][b - a - 1]: tokens and targets row a shares with each later row b, up to each one's
    # last kept token but one (a shared prefix leaves every sample a token of its own)
    common: list[list[int]] = []
    for a in range(n):
        later = rows[a + 1 :]
        if not later:
            common.append([])
            continue
        same = (ids[later] == ids[rows[a]]) & (targets[later] == targets[rows[a]])
        run = same.int().cumprod(1).sum(1).tolist()
        common.append([min(r, keep[rows[a]] - 1, keep[b] - 1) for r, b in zip(run, later, strict=True)])
    best, cut = [0] * (n + 1), [0] * (n + 1)  # best[j]: most tokens left out of rows[:j]
    for j in range(1, n + 1):
        best[j], cut[j] = best[j - 1], j - 1
    for a in range(n):
        shared = None
        for b in range(a + 1, n):  # the run rows[a..b]
            shared = common[a][b - a - 1] if shared is None else min(shared, common[a][b - a - 1])
            if shared < MIN_SHARED_PREFIX:
                break
            if best[a] + (b - a) * shared > best[b + 1]:
                best[b + 1], cut[b + 1] = best[a] + (b - a) * shared, a
    groups, j = [], n
    while j:
        groups.append(rows[cut[j] : j])
        j = cut[j]
    return groups[::-1]


def pack(
    batch: dict[str, torch.Tensor], share_prefix: bool | Sequence[Hashable] = True, keep_tails: bool = False
) -> dict[str, Any] | None:
    """``(B, L)`` right-padded -> model inputs for one row, with ``targets (1, T)``, ``gather``
    (None unless a shared prefix holds targets, see the module docstring) and ``where`` (``(B, L)``:
    each padded position's place in the row, -1 where left out); None when the batch
    has no target or is not right-padded samples starting at position 0.

    ``share_prefix``: True holds the prefix every sample shares once, or where that leaves out
    more tokens, the prefix of each run of consecutive rows that start alike (``_prefix_groups``);
    a sequence of one key per row (the adapter each row runs through) holds the prefix of each run
    of consecutive rows with equal keys once, before them; False shares nothing. ``keep_tails``:
    every real token stays in the row, each sample's tail after its last target too (the MoE
    router's load-balancing loss counts every token the padded batch routes,
    ``twinkle.model.router_aux``)."""
    mask = batch["attention_mask"].bool()
    lengths = mask.sum(1)
    positions = batch["position_ids"]
    arange = torch.arange(mask.shape[1], device=mask.device)
    right_padded = bool((mask == (arange[None, :] < lengths[:, None])).all())
    if not right_padded or not bool((positions[mask] == arange.expand_as(positions)[mask]).all()):
        return None
    targets = shifted_targets(batch["labels"], mask)
    scored = targets != IGNORE_INDEX
    keep = scored_lengths(targets)
    if not any(keep):
        return None
    if keep_tails:
        keep = lengths.tolist()
    rows = [i for i, n in enumerate(keep) if n > 0]
    ids = batch["input_ids"]
    if share_prefix is True:
        groups = _prefix_groups(ids, targets, keep, rows)
    elif share_prefix is False:
        groups = [[i] for i in rows]
    else:
        groups = row_groups(rows, share_prefix)
    # (ids, positions, targets) of each group's prefix, then of each of its samples' own part
    pieces, spans, blocks, owned, start = [], [], [], [], 0
    for group in groups:
        shared = _shared(ids, targets, keep, group)
        blocks.append((start, shared, len(group)))
        pieces.append((ids[group[0], :shared], arange[:shared], targets[group[0], :shared]))
        begin, start = start, start + shared
        for i in group:
            n = keep[i]
            pieces.append((ids[i, shared:n], arange[shared:n], targets[i, shared:n]))
            spans.append((start, start + n - shared))
            owned.append((i, begin, shared, start))
            start += n - shared
    input_ids, position_ids, row_targets = (torch.cat(column)[None] for column in zip(*pieces, strict=True))
    gather = None
    if any(shared and bool(scored[i, :shared].any()) for i, _, shared, _ in owned):
        gather = torch.cat(
            [
                torch.cat([arange[:shared] + begin, arange[shared : keep[i]] + (own - shared)])[
                    scored[i, : keep[i]]
                ]
                for i, begin, shared, own in owned
            ]
        )
    one_prefix = len(groups) == 1 or not any(n for _, n, _ in blocks)
    # each padded position's place in the row (-1: left out); routing replay lays routes out by it
    where = torch.full(ids.shape, -1, dtype=torch.long, device=ids.device)
    for i, begin, shared, own in owned:
        where[i, :shared] = arange[:shared] + begin
        where[i, shared : keep[i]] = arange[shared : keep[i]] + (own - shared)
    return {
        "input_ids": input_ids,
        "position_ids": position_ids,
        # all ones: Hugging Face's masking then builds no mask; attention follows the segments
        "attention_mask": torch.ones_like(input_ids),
        "targets": row_targets,
        "twinkle_segments": Segments(
            tuple(spans), blocks[0][1] if one_prefix else 0, () if one_prefix else tuple(blocks)
        ),
        "gather": gather,
        "where": where,
    }
