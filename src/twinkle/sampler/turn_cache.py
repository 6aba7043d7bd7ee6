"""The keys and values of finished rows, kept for the next turn of a conversation.

A multi-turn rollout asks the sampler again with the previous prompt, the reply and the
environment's answer: everything up to the reply's last token was already run. ``TurnCache``
keeps, per finished row, its tokens and each layer's keys and values at them, and a later prompt
that starts with a kept row's tokens (the longest common prefix) runs only the tokens after it.

Kept values are only right for the weights that made them: an entry belongs to the adapter it was
decoded under and to the weights' version (``weights_version``: the parameters' in-place update
counters and a checksum of the trainable ones, which every optimizer step and weight load
moves), and any other version empties the cache. It holds at most ``budget_bytes``; the oldest rows go first."""

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

DEFAULT_BUDGET_BYTES = 512 * 2**20  # about 5,700 tokens of SmolLM2-135M (92 KiB each)
MIN_REUSE = 8  # tokens a match must cover to be worth a ragged prefill instead of the plain one


@dataclass
class Kept:
    tokens: tuple[int, ...]
    keys: list[torch.Tensor]  # per layer (kv_heads, length, head_dim)
    values: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


def weights_version(lm: torch.nn.Module) -> tuple:
    """What moves whenever the weights change: the parameters' in-place update counters (a load,
    a weight sync) and a float64 sum of each trainable one (an optimizer may write a parameter's
    storage without moving its counter; trainable weights are an adapter's, small to sum)."""
    counters, sums = 0, []
    for p in lm.parameters():
        counters += p._version
        if p.requires_grad:
            sums.append(p.detach().sum(dtype=torch.float64))
    return counters, tuple(torch.stack(sums).tolist()) if sums else ()


def common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class TurnCache:
    """Finished rows' keys and values by their tokens (see the module docstring)."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES):
        self.budget_bytes = budget_bytes
        self.entries: OrderedDict[int, Kept] = OrderedDict()
        self._next = 0
        self._owner: tuple[Any, Any] | None = None  # (adapter, weights version) of the entries
        self.bytes = 0
        self.reused_tokens = 0  # prompt tokens not run again, since the cache was made

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0

    def check_owner(self, adapter: Any, version: Any) -> None:
        """Empty the cache unless its entries were made under ``adapter`` at ``version``."""
        if self._owner != (adapter, version):
            self.clear()
            self._owner = (adapter, version)

    def put(self, tokens: Iterable[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        kept = Kept(tuple(tokens), keys, values)
        if kept.nbytes > self.budget_bytes or not kept.tokens:
            return
        self.entries[self._next] = kept
        self._next += 1
        self.bytes += kept.nbytes
        while self.bytes > self.budget_bytes:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.nbytes

    def match(self, prompt: list[int]) -> tuple[int, Kept | None]:
        """The kept row sharing the longest prefix with ``prompt`` and that length, leaving the
        prompt's last token to run (its logits start the decoding); (0, None) below ``MIN_REUSE``."""
        best, best_len = None, 0
        for key, kept in self.entries.items():
            n = min(common_prefix(kept.tokens, prompt), len(prompt) - 1)
            if n > best_len:
                best, best_len = key, n
        if best is None or best_len < MIN_REUSE:
            return 0, None
        self.entries.move_to_end(best)  # recently used: kept longest
        return best_len, self.entries[best]
