"""Scoring without training: the top-k log-probabilities (and the log-probability of the token
that follows) at each scored position of a batch of rows, from one inference-only forward.

``topk_at_targets(lm, batch, k)`` is what a distillation teacher (``twinkle.model.teacher``) and a
sampler's ``prompt_logprobs`` (``twinkle.sampler.scoring``) compute. Against a plain forward of the
padded batch followed by ``log_softmax`` and ``topk`` it leaves out work, never changes what is
computed:

- the rows are packed end to end (``twinkle.model.packing``): no padding, no tail after a row's
  last scored position, and a prefix that rows share (the system prompt and chat markup, or a
  whole prompt whose completions follow one another) runs once;
- the output head runs only at the scored positions, each scored row position once (a scored
  shared prefix is copied out to every row that holds it), in blocks of at most ``BLOCK_BYTES`` of
  logits, so scoring long rows never holds a ``(positions, vocab)`` tensor of the whole batch;
- each block's log-sum-exp is taken in place in the logits after ``topk`` (whose first value is
  the row's maximum), so no second ``(positions, vocab)`` tensor is written;
- ``torch.inference_mode`` (no autograd bookkeeping), ``use_cache=False``;
- on a CPU, the body's plain linear layers compute through ``twinkle.kernel.cpu_gemm``, as the
  head does (oneDNN by the fixed rule training's frozen products follow, ``TWINKLE_ONEDNN``): at a few
  hundred rows it ran SmolLM2-135M's products in under half of the time of torch's default
  library.

Each changes summation order only (about 1e-6 relative in fp32). Fusing the q/k/v and gate/up
products into one product each was measured to save about 3% of those products' time through
oneDNN, not worth a second copy of those weights, so the layers run as the model defines them."""

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from twinkle.kernel import cpu_gemm
from twinkle.kernel.lora.linear import plain_linear
from twinkle.loss.head import head_logits
from twinkle.model.forward import full_weight, has_logit_transform, head_as_identity
from twinkle.model.packing import can_pack, pack, shifted_targets
from twinkle.model.ulysses import ulysses_of
from twinkle.template.base import IGNORE_INDEX

BLOCK_BYTES = 256 << 20  # fp32 logits the head writes at a time: 1365 positions at a 49k vocabulary


@dataclass
class TopkScores:
    """At each scored position of the padded batch, in row-major order: the ``k`` largest
    log-probabilities and their token ids ``(N, k)``, and the log-probability of the position's
    target ``(N,)``."""

    values: torch.Tensor
    indices: torch.Tensor
    chosen: torch.Tensor


def vocab_size(lm: Any) -> int:
    """The number of tokens ``lm``'s output head scores (its rows, padding included)."""
    head = lm.get_output_embeddings()
    out = getattr(head, "out_features", None)
    return int(out if out is not None else head.weight.shape[0])


def _linear_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    out = cpu_gemm.linear(x.reshape(-1, x.shape[-1]), module.weight, module.bias)
    return out.reshape(*x.shape[:-1], out.shape[-1])


@contextlib.contextmanager
def cpu_gemm_linears(lm: Any) -> Iterator[None]:
    """While the block runs, ``lm``'s plain ``nn.Linear`` layers (LoRA base layers included)
    compute through ``cpu_gemm.linear``, which takes fp32 CPU products without autograd and
    leaves every other call to torch. Layers that already run a forward of their own (a sampler's
    routed copy), sharded weights and models off the CPU are left as they are."""
    if any(p.device.type != "cpu" or hasattr(p, "full_tensor") for p in lm.parameters()):
        yield
        return
    layers = [m for m in lm.modules() if type(m) is nn.Linear and "forward" not in m.__dict__]
    for module in layers:
        module.forward = functools.partial(_linear_forward, module)
    try:
        yield
    finally:
        for module in layers:
            module.__dict__.pop("forward", None)


def head_topk(
    hidden: torch.Tensor, head: nn.Module, k: int, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(values, indices, chosen)`` of ``log_softmax(head(hidden))`` for 2-D ``hidden``: its
    top ``k`` and its value at ``targets``, blocks of rows at a time (see the module docstring)."""
    weight = full_weight(head.weight)
    bias = None if getattr(head, "bias", None) is None else full_weight(head.bias)
    rows = max(1, BLOCK_BYTES // (4 * weight.shape[0]))
    out = [_logits_topk(head_logits(part, weight, bias).float(), k, t) for part, t in
           zip(hidden.split(rows), targets.split(rows), strict=True)]  # fmt: skip
    return tuple(torch.cat(column) for column in zip(*out, strict=True))


def _logits_topk(
    logits: torch.Tensor, k: int, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top ``k`` and the targets' log-probabilities of ``logits`` ``(N, vocab)``, which it
    overwrites: the log-sum-exp is computed in place once the logits' values are read."""
    values, indices = logits.topk(k, dim=-1)
    shift = values[:, :1] if k else logits.amax(-1, keepdim=True)
    shift = torch.where(shift.isfinite(), shift, torch.zeros_like(shift))  # a row of -inf stays -inf
    chosen = logits.gather(-1, targets[:, None])
    lse = shift + logits.sub_(shift).exp_().sum(-1, keepdim=True).log()
    return values - lse, indices, (chosen - lse)[:, 0]


def _hidden(
    lm: Any, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The scored positions' hidden states (or logits, where the head cannot run apart), each
    distinct position once; their targets; and for each scored position of the padded batch in
    row-major order the index of its row among them (None: the same order)."""
    packed = None
    if can_pack(lm) and ulysses_of(lm) is None:
        ids = batch["input_ids"]
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        packed = pack({"position_ids": positions, **batch}, True)
    if packed is None:  # the padded batch, as given
        targets = shifted_targets(batch["labels"], batch["attention_mask"])
        inputs = {key: value for key, value in batch.items() if key != "labels"}
        where, order = targets != IGNORE_INDEX, None
    else:
        targets, gather = packed.pop("targets"), packed.pop("gather")
        packed.pop("where")
        inputs, where = packed, targets != IGNORE_INDEX
        order = None
        if gather is not None:  # a scored shared prefix: its positions are scored once
            place = torch.full(targets.shape[1:], -1, dtype=torch.long, device=targets.device)
            place[where[0]] = torch.arange(int(where.sum()), device=targets.device)
            order = place[gather]
    head = lm.get_output_embeddings()
    if has_logit_transform(lm) or not plain_linear(head):
        return lm(**inputs, use_cache=False).logits[where], targets[where], order
    with head_as_identity(head):
        return lm(**inputs, use_cache=False).logits[where], targets[where], order


def topk_at_targets(lm: Any, batch: dict[str, torch.Tensor], k: int) -> TopkScores:
    """``lm``'s scores (``TopkScores``) at each position of the right-padded ``batch``
    (``input_ids``, ``attention_mask``, ``labels`` aligned with the inputs) whose next token has
    a label. ``lm`` runs in the mode it is in (a teacher puts it in eval mode first)."""
    if not bool((shifted_targets(batch["labels"], batch["attention_mask"]) != IGNORE_INDEX).any()):
        device = batch["input_ids"].device
        empty = torch.zeros((0, k), device=device)
        return TopkScores(empty, empty.long(), torch.zeros(0, device=device))
    head = lm.get_output_embeddings()
    with torch.inference_mode(), cpu_gemm_linears(lm):
        hidden, targets, order = _hidden(lm, batch)
        if has_logit_transform(lm) or not plain_linear(head):
            scores = _logits_topk(hidden.float(), k, targets)
        else:
            scores = head_topk(hidden, head, k, targets)
        if order is not None:
            scores = tuple(t[order] for t in scores)
    return TopkScores(*(t.clone() for t in scores))
