"""``DecodeBatch``: one decoding batch that sample requests of different adapters join as they
arrive and leave as they finish (continuous batching), so a step runs every request's rows in one
forward instead of one forward per request.

A request (``Stream``) keeps what makes its tokens its own: its adapter, its ``SamplingParams``,
a ``torch.Generator`` seeded with its seed, its stop conditions and budget, and its rows of the
KV cache. It is prefilled alone under its adapter, as ``twinkle.sampler.decode.Decoder`` prefills
one prompt (its cache repeated for its ``num_samples``), and joins the batch at the next step.
Each step then runs every row in one forward, each row through its own adapter (``adapters.rows``;
one adapter for all rows is activated as a lone sample activates it), and each request picks its
rows' tokens from its own logits with its own generator, in the order ``Decoder`` does. So a
request draws the tokens it draws alone: the same draws from logits that differ from a lone
run's by the summation order of a wider product at most.

The KV rows (``BatchCache``) are right-aligned in one buffer per layer, the columns before a
row's first position padding that the attention mask hides; each row keeps its own positions.
Columns that are padding in every row are dropped when rows leave, so a batch that never empties
is no wider than the longest request in it. A prefill that fails fails its request alone; a step
that fails fails every request in the batch (the batch starts empty again): their rows were in
the same forward."""

import collections
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from twinkle.data_format.sampling import SamplingParams
from twinkle.sampler.choose import choose, token_logprobs
from twinkle.sampler.decode import CacheState, RowOutput, cache_keyword
from twinkle.sampler.lean_step import GROW, LeanCache, lean_step
from twinkle.sampler.stops import Stops, eos_token_ids
from twinkle.utils.errors import UserError


@dataclass
class Stream:
    """One request in the batch: its ``rows`` (``num_samples`` of them), those still generating
    (``alive``, in batch order), the seconds of decoding it took part in (``ran``), and whether
    it is done (or failed: ``error``)."""

    adapter: str
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    stops: Stops
    budget: int
    rows: list[RowOutput] = field(default_factory=list)
    alive: list[int] = field(default_factory=list)
    ran: float = 0.0
    done: bool = False
    error: BaseException | None = None

    def result(self) -> list[RowOutput]:
        if self.error is not None:
            raise self.error
        return self.rows


class BatchCache(LeanCache):
    """The batch's KV rows (``LeanCache``'s layout); ``mask`` ``(rows, length)``, 1 where a row
    has a position (None: every column, no padding), ``positions`` each row's next position."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], positions: torch.Tensor):
        super().__init__(keys, values)
        self.mask: torch.Tensor | None = None
        self.positions = positions

    @property
    def rows(self) -> int:
        return self.keys[0].shape[0]

    def step_mask(self) -> torch.Tensor | None:
        """The mask of the step about to run (one more column, the new position), kept."""
        if self.mask is not None:
            self.mask = torch.cat([self.mask, self.mask.new_ones(self.rows, 1)], dim=1)
        return self.mask

    def join(self, other: "BatchCache") -> None:
        """``other``'s rows after this cache's, both right-aligned to the longer one."""
        length, mine_rows = max(self.length, other.length), self.rows
        rows = mine_rows + other.rows
        mask = self.keys[0].new_zeros((rows, length), dtype=torch.long)
        for part, at in ((self, slice(0, mine_rows)), (other, slice(mine_rows, rows))):
            mask[at, length - part.length :] = 1 if part.mask is None else part.mask

        def joined(mine: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
            out = mine.new_zeros((rows, mine.shape[1], length + GROW, mine.shape[3]))
            out[:mine_rows, :, length - self.length : length] = mine[:, :, : self.length]
            out[mine_rows:, :, length - other.length : length] = theirs[:, :, : other.length]
            return out

        self.keys = [joined(a, b) for a, b in zip(self.keys, other.keys, strict=True)]
        self.values = [joined(a, b) for a, b in zip(self.values, other.values, strict=True)]
        self.positions = torch.cat([self.positions, other.positions])
        self.length, self.mask = length, mask
        self._unpad()

    def select(self, index: torch.Tensor) -> None:
        """Keep rows ``index``; drop the columns that are padding in every row kept."""
        self.positions = self.positions[index]
        first = 0
        if self.mask is not None:
            self.mask = self.mask[index]
            first = int((self.mask.cumsum(dim=1) == 0).sum(dim=1).min())
            self.mask = self.mask[:, first:]
        self.length -= first
        self.keys = [t.index_select(0, index)[:, :, first:].contiguous() for t in self.keys]
        self.values = [t.index_select(0, index)[:, :, first:].contiguous() for t in self.values]
        self._unpad()

    def _unpad(self) -> None:
        if self.mask is not None and bool(self.mask.all()):
            self.mask = None  # no padding left: no mask to pass, as a lone sample passes none


class DecodeBatch:
    """The shared batch over ``lm`` (a causal LM module). ``adapters`` runs the model's adapters:
    ``decoding_chunk()`` around each chunk of decoding, ``one(name)`` for one adapter on every row,
    ``rows(runs)`` for runs ``(start, end, name)`` of rows (``twinkle.sampler.row_adapters``)."""

    def __init__(self, lm: Any, tokenizer: Any, adapters: Any):
        self.lm, self.tokenizer, self.adapters = lm, tokenizer, adapters
        self.device = next(lm.parameters()).device
        self.cache_kw = cache_keyword(lm)
        self.lean = lean_step(lm)  # decoding steps written out where they reproduce lm's
        self.limit = getattr(lm.config, "max_position_embeddings", None)
        self.eos = eos_token_ids(lm, tokenizer)
        self.pending: collections.deque[Stream] = collections.deque()
        self.streams: list[Stream] = []  # in the batch, in row order
        self.cache: BatchCache | None = None
        self.logits: torch.Tensor | None = None  # (rows, vocab): the next pick's, one row per alive row

    # ------------------------------------------------------------------ requests
    def add(self, adapter: str, prompt: list[int], params: SamplingParams, seed: int) -> Stream:
        """A request that joins at the next chunk (``run``)."""
        if params.repetition_penalty != 1 or params.prompt_logprobs is not None or params.max_tokens == 0:
            raise UserError(
                "a shared decoding batch generates: no repetition_penalty, prompt_logprobs or max_tokens=0"
            )
        if self.limit is not None and len(prompt) + 1 > self.limit:
            raise UserError(
                f"the prompt has {len(prompt)} tokens, but the model takes at most {self.limit} positions"
            )
        room = None if self.limit is None else self.limit - len(prompt)
        if params.max_tokens is None and room is None:
            raise UserError("the model has no maximum positions; set SamplingParams(max_tokens=...)")
        stream = Stream(
            adapter=adapter,
            prompt=list(prompt),
            params=params,
            generator=torch.Generator(device=self.device).manual_seed(seed),
            stops=Stops(self.tokenizer, self.eos, params),
            budget=min(x for x in (params.max_tokens, room) if x is not None),
        )
        self.pending.append(stream)
        return stream

    def drop(self, stream: Stream) -> None:
        """``stream`` leaves (cancelled, or stopped at a time limit): its rows leave the batch."""
        if stream in self.pending:
            self.pending.remove(stream)
        if stream not in self.streams:
            return
        first = self._offset(stream)
        keep = [i for i in range(self.cache.rows) if not first <= i < first + len(stream.alive)]
        self.streams.remove(stream)
        self._keep(keep)

    # ------------------------------------------------------------------ decoding
    def run(self, seconds: float | None, until: Stream | None = None) -> None:
        """Admit the requests waiting, then decode for about ``seconds`` (at least one step; None:
        no limit) or until the batch is empty or ``until`` is done."""
        end = None if seconds is None else time.perf_counter() + seconds
        try:
            with torch.no_grad(), self.adapters.decoding_chunk():
                while self.pending:
                    stream = self.pending.popleft()
                    try:
                        self._admit(stream)
                    except Exception as exc:  # noqa: BLE001 (its prefill ran alone: it fails alone)
                        stream.error, stream.done = exc, True
                while self.streams:
                    start, present = time.perf_counter(), list(self.streams)
                    self._step()
                    spent = time.perf_counter() - start
                    for stream in present:
                        stream.ran += spent
                    if (until is not None and until.done) or (end is not None and time.perf_counter() >= end):
                        break
        except BaseException as exc:
            self._fail(exc)
            raise

    def _admit(self, stream: Stream) -> None:
        """Prefill ``stream`` alone under its adapter (``Decoder._prefill`` of one prompt) and add its
        rows to the batch."""
        start = time.perf_counter()
        n = stream.params.num_samples
        ids = torch.tensor([stream.prompt], device=self.device)
        positions = torch.arange(len(stream.prompt), device=self.device)[None]
        state = CacheState(self.lm.config, torch.ones_like(ids), False)
        with self.adapters.one(stream.adapter):
            out = self.lm(
                input_ids=ids,
                attention_mask=None,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **{self.cache_kw: state.cache},
            )
        logits = out.logits[:, -1].float()
        if n > 1:
            state.repeat(n)
            logits = logits.repeat_interleave(n, dim=0)
        layers = state.cache.layers
        cache = BatchCache(
            [layer.keys for layer in layers],
            [layer.values for layer in layers],
            torch.full((n,), len(stream.prompt), dtype=torch.long, device=self.device),
        )
        stream.rows = [RowOutput() for _ in range(n)]
        stream.alive = list(range(n))
        if self.cache is None:
            self.cache, self.logits = cache, logits
        else:
            self.cache.join(cache)
            self.logits = torch.cat([self.logits, logits])
        self.streams.append(stream)
        stream.ran += time.perf_counter() - start

    def _step(self) -> None:
        """Each request picks its rows' tokens; the rows that go on run one forward together."""
        keep, offset = [], 0
        for stream in list(self.streams):
            count = len(stream.alive)
            kept = pick(stream, self.logits[offset : offset + count])
            keep += [offset + i for i in kept]
            stream.alive = [stream.alive[i] for i in kept]
            offset += count
            if not stream.alive:
                stream.done = True
                self.streams.remove(stream)
        self._keep(keep)
        if not self.streams:
            return
        last = [stream.rows[r].tokens[-1] for stream in self.streams for r in stream.alive]
        ids = torch.tensor(last, device=self.device)[:, None]
        names = {stream.adapter for stream in self.streams}
        if len(names) == 1:
            with self.adapters.one(names.pop()):
                self.logits = self._forward(ids)
        else:
            with self.adapters.rows(self._runs()):
                self.logits = self._forward(ids)

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        """One new position per row; its fp32 logits ``(rows, vocab)``."""
        cache = self.cache
        positions = cache.positions[:, None]
        mask = cache.step_mask()
        cache.positions = cache.positions + 1
        if self.lean is not None:
            return self.lean(ids, positions, cache, mask)
        from transformers import DynamicCache

        n = cache.length
        view = DynamicCache(
            ddp_cache_data=[(k[:, :, :n], v[:, :, :n]) for k, v in zip(cache.keys, cache.values, strict=True)]
        )
        out = self.lm(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_kw: view},
        )
        for i, layer in enumerate(view.layers):
            cache.write(i, layer.keys[:, :, -1:], layer.values[:, :, -1:])
        cache.advance()
        return out.logits[:, -1].float()

    # ------------------------------------------------------------------ bookkeeping
    def _runs(self) -> list[tuple[int, int, str]]:
        runs, start = [], 0
        for stream in self.streams:
            runs.append((start, start + len(stream.alive), stream.adapter))
            start += len(stream.alive)
        return runs

    def _offset(self, stream: Stream) -> int:
        return sum(len(s.alive) for s in self.streams[: self.streams.index(stream)])

    def _keep(self, keep: list[int]) -> None:
        if not keep:
            self.cache, self.logits = None, None
        elif len(keep) < self.cache.rows:
            index = torch.tensor(keep, device=self.device)
            self.cache.select(index)
            self.logits = self.logits[index]

    def _fail(self, exc: BaseException) -> None:
        for stream in [*self.streams, *self.pending]:
            stream.error, stream.done = exc, True
        self.streams, self.cache, self.logits = [], None, None
        self.pending.clear()


def pick(stream: Stream, logits: torch.Tensor) -> list[int]:
    """``Decoder._step`` for one request: its alive rows' next tokens from ``logits`` (one row each)
    drawn with its generator and recorded; the positions (in ``stream.alive``) that go on."""
    params = stream.params
    alternatives = max(0, (params.logprobs or 1) - 1)
    tokens = choose(logits, params, stream.generator)
    chosen, top_ids, top_values = token_logprobs(logits, tokens, alternatives)
    token_list, chosen_list = tokens.tolist(), chosen.tolist()
    tops = None if top_ids is None else (top_ids.tolist(), top_values.tolist())
    keep = []
    for pos, row_id in enumerate(stream.alive):
        row, token = stream.rows[row_id], token_list[pos]
        entry = [(token, chosen_list[pos])]
        if tops is not None:
            others = [(t, v) for t, v in zip(tops[0][pos], tops[1][pos], strict=True) if t != token]
            entry += others[:alternatives]
        row.tokens.append(token)
        row.logprobs.append(entry)
        if token in stream.stops.token_ids:
            row.stop_reason = "stop"
        elif stream.stops.hit(row.tokens):
            row.stop_reason, row.by_string = "stop", True
        elif len(row.tokens) >= stream.budget:
            row.stop_reason = "length"
        else:
            keep.append(pos)
    return keep
