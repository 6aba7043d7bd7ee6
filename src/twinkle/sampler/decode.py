"""Batched generation with a KV cache, one token per row and step, rows stopping independently.

The loop calls the model's own forward step by step with a transformers ``DynamicCache``
(rather than ``model.generate``), because it needs, at every step and for every row: the
model's log-probability of the sampled token at temperature 1 (``generate`` hands processed
scores), its own stop test (end-of-sequence tokens, stop token ids, stop strings, a budget per
row), and draws from one ``torch.Generator`` seeded per call. It also does less work than
``generate``:

- the prompts are left-padded once (position ids count from each row's first real token, the
  attention mask hides the pads) and each prompt is run once even when ``num_samples > 1``: its
  cache rows are repeated afterwards;
- the prompts' common prefix (a chat template's system turn, say) runs once, in a row of its own,
  and its cache is repeated for every prompt before the rest of each prompt runs: the pads then
  sit between the prefix and the rest, hidden by the mask as before (on a model whose cache has
  sliding-window or linear-attention layers, only where every rest is equally long: a sliding
  window counts cache slots, pads included, and a recurrent state decays over the pads);
- only the last position's logits are computed (``logits_to_keep=1``);
- a row that stops leaves the batch (its cache rows are dropped), so later steps run only the
  rows still generating, and a batch without pads passes no attention mask at all.

Under FSDP (a sampler sharing a sharded model) every rank must run the same forwards: the ranks
agree each step on whether any of them still generates (``lockstep``), and a rank with nothing
left runs a one-token pass without cache until all are done."""

from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import torch

from twinkle.data_format.sampling import SamplingParams
from twinkle.sampler.choose import choose, token_logprobs
from twinkle.sampler.lean_step import LeanCache, lean_step
from twinkle.sampler.routes import RouteLog
from twinkle.sampler.stops import Stops
from twinkle.sampler.turn_cache import TurnCache
from twinkle.sampler.vision_prefill import placeholder_ids, prefill_with_images


@dataclass
class RowOutput:
    """What one sequence generated (see ``twinkle.data_format.sampling.SampledSequence``)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    stop_reason: str = "length"
    by_string: bool = False
    routed_experts: Any = None  # (tokens, moe_layers, top_k) where the decoder keeps a RouteLog


def cache_keyword(lm: Any) -> str:
    """The name of the forward's cache argument: ``cache`` (transformers >= 5.x) or
    ``past_key_values`` (earlier)."""
    import inspect

    params = inspect.signature(type(lm).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class Decoder:
    """One ``sample`` call's generation over ``lm`` (a causal LM module, in eval mode)."""

    def __init__(
        self,
        lm: Any,
        params: SamplingParams,
        stops: Stops,
        pad_id: int,
        generator: torch.Generator,
        lockstep: Callable[[bool], bool] | None = None,
        routes: RouteLog | None = None,
        turns: TurnCache | None = None,
    ):
        self.lm, self.params, self.stops, self.pad_id = lm, params, stops, pad_id
        self.generator, self.lockstep = generator, lockstep
        self.device = next(lm.parameters()).device
        self.cache_kw = cache_keyword(lm)
        self.alternatives = max(0, (params.logprobs or 1) - 1)
        # an image's placeholder tokens are never drawn: a row holding one has no image for it
        self.placeholders = placeholder_ids(lm, self.device)
        # decoding steps written out (``twinkle.sampler.lean_step``) where they reproduce lm's
        self.lean = lean_step(lm) if lockstep is None and routes is None else None
        self.routes = routes  # each forward's experts, per row (``twinkle.sampler.routes``)
        # finished rows' keys and values for a later turn; plain attention layers only (a
        # recurrent or sliding-window layer's cache is not a list of positions to reuse)
        plain_layers = plain_cache_layers(lm.config)
        plain = lockstep is None and routes is None and plain_layers
        self.turns = turns if plain else None
        # pads between a shared prefix and the rests would move a sliding window or a recurrent
        # state: such a model runs a prefix apart only where the rests are equally long
        self.even_rests = not plain_layers

    def run(
        self, prompts: list[list[int]], budgets: list[int], visions: list[Any] | None = None
    ) -> list[list[RowOutput]]:
        """Generate ``params.num_samples`` sequences for each prompt; ``budgets[i]``: the most
        tokens prompt i's sequences may have; ``visions[i]``: prompt i's images (None: none,
        ``twinkle.sampler.vision_prefill``). Returns, per prompt, its sequences."""
        return drain(self.steps(prompts, budgets, visions))

    def steps(
        self, prompts: list[list[int]], budgets: list[int], visions: list[Any] | None = None
    ) -> Generator[None, None, list[list[RowOutput]]]:
        """``run`` as a generator that pauses after the prefill and after each decoding step (its
        return value is ``run``'s): a caller can run other work on the model between steps, as
        long as it runs each step under the same adapter and in eval mode."""
        n = self.params.num_samples
        rows = [RowOutput() for _ in range(len(prompts) * n)]
        budget = [b for b in budgets for _ in range(n)]
        if not prompts:
            self._idle()
            return []
        if visions is not None and any(v is not None for v in visions):
            shared = 0 if self.lockstep is not None else shared_prefix(prompts, self.even_rests)
            logits, state = prefill_with_images(self, prompts, visions, shared, SHARED_MIN, CacheState)
        else:
            logits, state = self._prefill(prompts)
        self.prompts = prompts
        if self.lean is not None:
            state.lean, state.cache = LeanCache.of(state.cache), None
        alive = list(range(len(rows)))
        while True:
            yield
            keep = self._step(logits, alive, rows, budget)
            if self.turns is not None and len(keep) < len(alive):
                self._keep_finished(state, alive, keep, rows)
            if not self._continue(bool(keep)):
                break
            if not keep:
                self._idle()
                break
            if len(keep) < len(alive):
                state.select(keep)
                alive = [alive[i] for i in keep]
            last = torch.tensor([rows[r].tokens[-1] for r in alive], device=self.device)
            logits = self._forward(last[:, None], state)
            if self.routes is not None:
                self.routes.step_ran(alive)
        if self.routes is not None:
            for i, row in enumerate(rows):
                row.routed_experts = self.routes.routes(i)
        return [rows[i * n : (i + 1) * n] for i in range(len(prompts))]

    # ------------------------------------------------------------------ steps
    def _keep_finished(
        self, state: "CacheState", alive: list[int], keep: list[int], rows: list[RowOutput]
    ) -> None:
        """Put each row that just stopped into ``turns``: the keys and values at its real
        positions, which hold its prompt and every token it generated but the last (never run)."""
        n, kept = self.params.num_samples, set(keep)
        layers = (
            list(zip(state.lean.keys, state.lean.values, strict=True))
            if state.lean is not None
            else [(layer.keys, layer.values) for layer in state.cache.layers]
        )
        length = state.lean.length if state.lean is not None else layers[0][0].shape[2]
        for pos, row_id in enumerate(alive):
            if pos in kept:
                continue
            tokens = self.prompts[row_id // n] + rows[row_id].tokens[:-1]
            real = state.mask[pos, :length].bool() if state.padded else slice(None)
            keys = [k[pos, :, :length][:, real].clone() for k, _ in layers]
            if keys[0].shape[1] != len(tokens):  # not the layout this expects: keep nothing
                continue
            values = [v[pos, :, :length][:, real].clone() for _, v in layers]
            self.turns.put(tokens, keys, values)

    def _prefill(self, prompts: list[list[int]]) -> tuple[torch.Tensor, "CacheState"]:
        if self.turns is not None:
            hits = [self.turns.match(p) for p in prompts]
            if any(kept is not None for _, kept in hits):
                return self._prefill_after(prompts, hits)
        shared = 0 if self.lockstep is not None else shared_prefix(prompts, self.even_rests)
        rests = [p[shared:] for p in prompts]
        width = max(len(p) for p in rests)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(rests):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        padded = any(len(p) < width for p in rests)
        mask = mask.to(self.device)
        if shared:
            state = CacheState(
                self.lm.config, torch.ones((1, shared), dtype=torch.long, device=self.device), False
            )
            head = torch.tensor([prompts[0][:shared]], device=self.device)
            self._forward(head, state, torch.arange(shared, device=self.device)[None])
            if self.routes is not None:
                self.routes.prefix_ran()
            state.repeat(len(prompts))
            state.mask, state.padded = torch.cat([state.mask, mask], dim=1), padded
        else:
            state = CacheState(self.lm.config, mask, padded)
        positions = shared + (mask.cumsum(-1) - 1).clamp(min=0)
        logits = self._forward(ids.to(self.device), state, positions)
        if self.routes is not None:
            self.routes.prompts_ran([len(p) for p in rests], width)
        n = self.params.num_samples
        if n > 1:
            state.repeat(n)
            logits = logits.repeat_interleave(n, dim=0)
        return logits, state

    def _prefill_after(
        self, prompts: list[list[int]], hits: list[tuple[int, Any]]
    ) -> tuple[torch.Tensor, "CacheState"]:
        """The prefill when some prompts start with a kept row: each row's cache is its kept
        keys and values (left-padded to the longest), and only the rest of each prompt runs
        (left-padded too); the pads of both parts are masked, the positions count real tokens."""
        rows = len(prompts)
        reused = [n for n, _ in hits]
        width_kept = max(reused)
        template = next(kept for _, kept in hits if kept is not None)
        layers = len(template.keys)
        heads, _, dim = template.keys[0].shape
        keys = [template.keys[i].new_zeros((rows, heads, width_kept, dim)) for i in range(layers)]
        values = [template.values[i].new_zeros((rows, heads, width_kept, dim)) for i in range(layers)]
        kept_mask = torch.zeros((rows, width_kept), dtype=torch.long)
        for r, (n, kept) in enumerate(hits):
            if kept is None:
                continue
            for i in range(layers):
                keys[i][r, :, width_kept - n :] = kept.keys[i][:, :n]
                values[i][r, :, width_kept - n :] = kept.values[i][:, :n]
            kept_mask[r, width_kept - n :] = 1
        rests = [p[n:] for p, n in zip(prompts, reused, strict=True)]
        width = max(len(p) for p in rests)
        ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        rest_mask = torch.zeros((rows, width), dtype=torch.long)
        for r, p in enumerate(rests):
            ids[r, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            rest_mask[r, width - len(p) :] = 1
        state = CacheState(self.lm.config, torch.cat([kept_mask, rest_mask], dim=1).to(self.device), True)
        for i in range(layers):
            state.cache.update(keys[i].to(self.device), values[i].to(self.device), i)
        positions = torch.tensor(reused)[:, None] + (rest_mask.cumsum(-1) - 1).clamp(min=0)
        logits = self._forward(ids.to(self.device), state, positions.to(self.device))
        self.turns.reused_tokens += sum(reused)
        n = self.params.num_samples
        if n > 1:
            state.repeat(n)
            logits = logits.repeat_interleave(n, dim=0)
        return logits, state

    def _forward(
        self,
        ids: torch.Tensor,
        state: "CacheState",
        positions: torch.Tensor | None = None,
        vision: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run ``ids`` (rows, tokens) after what the cache holds; the last position's fp32 logits.
        ``positions``: (rows, tokens), or (3, rows, tokens) M-RoPE positions; ``vision``: the
        images whose tokens ``ids`` hold (``twinkle.sampler.vision_prefill``)."""
        if positions is None:
            positions = state.next_positions[:, None]
            state.extend()
        mask = state.mask if state.padded else None
        if state.lean is not None:
            state.next_positions = positions[:, -1] + 1
            return self.lean(ids, positions, state.lean, mask)
        out = self.lm(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_kw: state.cache},
            **(vision or {}),
        )
        last = positions[..., -1]
        state.next_positions = (last if last.dim() == 1 else last.amax(0)) + 1
        return out.logits[:, -1].float()

    def _step(
        self, logits: torch.Tensor, alive: list[int], rows: list[RowOutput], budget: list[int]
    ) -> list[int]:
        """Pick each alive row's next token and record it; the positions (in ``alive``) of the
        rows that go on."""
        drawn_from = (
            logits if self.placeholders is None else logits.index_fill(-1, self.placeholders, -torch.inf)
        )
        tokens = choose(drawn_from, self.params, self.generator)  # log-probs: the model's own logits
        chosen, top_ids, top_values = token_logprobs(logits, tokens, self.alternatives)
        token_list, chosen_list = tokens.tolist(), chosen.tolist()
        tops = None if top_ids is None else (top_ids.tolist(), top_values.tolist())
        keep = []
        for pos, row_id in enumerate(alive):
            row, token = rows[row_id], token_list[pos]
            entry = [(token, chosen_list[pos])]
            if tops is not None:
                others = [(t, v) for t, v in zip(tops[0][pos], tops[1][pos], strict=True) if t != token]
                entry += others[: self.alternatives]
            row.tokens.append(token)
            row.logprobs.append(entry)
            if token in self.stops.token_ids:
                row.stop_reason = "stop"
            elif self.stops.hit(row.tokens):
                row.stop_reason, row.by_string = "stop", True
            elif len(row.tokens) >= budget[row_id]:
                row.stop_reason = "length"
            else:
                keep.append(pos)
        return keep

    def _continue(self, mine: bool) -> bool:
        return mine if self.lockstep is None else self.lockstep(mine)

    def _idle(self) -> None:
        """Under ``lockstep``, run one-token passes while another rank still generates."""
        if self.lockstep is None:
            return
        pad = torch.full((1, 1), self.pad_id, dtype=torch.long, device=self.device)
        while True:
            self.lm(input_ids=pad, use_cache=False, logits_to_keep=1)
            if not self.lockstep(False):
                return


def drain(steps: Generator[None, None, Any]) -> Any:
    """Run a generator of steps to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value


SHARED_MIN = 16  # prompt tokens a shared prefix must save to run apart (about one extra forward's cost)


def shared_prefix(prompts: list[list[int]], even: bool = False) -> int:
    """The tokens all ``prompts`` start with, where running them once saves at least
    ``SHARED_MIN`` tokens; each prompt keeps at least one token of its own (its last position's
    logits start the decoding). ``even``: only where the prompts' rests are equally long (no pads
    between the prefix and a rest). 0: no prefix run apart."""
    if len(prompts) < 2:
        return 0
    shortest = min(len(p) for p in prompts)
    shared = 0
    while shared < shortest - 1 and all(p[shared] == prompts[0][shared] for p in prompts):
        shared += 1
    if even and len({len(p) - shared for p in prompts}) > 1:
        return 0
    return shared if shared * (len(prompts) - 1) >= SHARED_MIN else 0


class CacheState:
    """The KV cache of the rows still generating, their attention mask (pads 0) and the
    position each row's next token takes."""

    def __init__(self, config: Any, mask: torch.Tensor, padded: bool):
        from transformers import DynamicCache

        try:  # the model's own layout of layers (sliding windows, ...)
            self.cache = DynamicCache(config=config)
        except TypeError:  # transformers before the cache took a config
            self.cache = DynamicCache()
        self.mask = mask
        self.padded = padded
        self.next_positions = torch.zeros(mask.shape[0], dtype=torch.long, device=mask.device)
        self.lean: LeanCache | None = None  # replaces ``cache`` after the prefill where it applies

    def extend(self) -> None:
        """One more position for every row (the token about to run)."""
        if self.padded:
            ones = torch.ones((self.mask.shape[0], 1), dtype=self.mask.dtype, device=self.mask.device)
            self.mask = torch.cat([self.mask, ones], dim=1)

    def select(self, keep: list[int]) -> None:
        index = torch.tensor(keep, device=self.mask.device)
        if self.lean is not None:
            self.lean.select(index)
        else:
            self.cache.reorder_cache(index)  # a row gather (see ``repeat``)
        self.mask = self.mask[index]
        self.next_positions = self.next_positions[index]
        if self.padded and bool(self.mask.all()):
            self.padded = False  # the rows left have no pads: no mask needed from here on

    def repeat(self, n: int) -> None:
        # a row gather through ``reorder_cache``: the linear-attention (recurrent) cache layers of
        # hybrid models (Qwen3.5, Qwen3-Next) implement it and not ``batch_repeat_interleave``
        rows = torch.arange(self.mask.shape[0], device=self.mask.device).repeat_interleave(n)
        self.cache.reorder_cache(rows)
        self.mask = self.mask.repeat_interleave(n, dim=0)
        self.next_positions = self.next_positions.repeat_interleave(n, dim=0)


def plain_cache_layers(config: Any) -> bool:
    """Whether every layer of the model's cache is a plain list of positions (full attention)."""
    from transformers import DynamicCache

    try:
        layers = DynamicCache(config=config).layers
    except TypeError:
        return False
    return bool(layers) and all(type(layer).__name__ == "DynamicLayer" for layer in layers)
