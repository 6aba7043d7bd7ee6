"""Adapter slots on a mixture-of-experts model's fused experts (PEFT's ``target_parameters``).

Each slot is a PEFT adapter; on an expert parameter (``mlp.experts.gate_up_proj``, ``down_proj``)
PEFT's ``ParamWrapper`` holds every slot's factors, over all the experts, and adds the active
slot's update to the parameter in the forward. A slot config that names ``target_parameters``
puts them there when the slots are attached. Otherwise the first adapter that names them puts
them there for every slot (``attach``), as long as the model is not placed yet: FSDP2 shards
only the weights present when it wraps, and expert parallelism keeps each rank's block of
experts then, after which an expert LoRA made over all the experts can no longer be added.
``MultiLoraTransformersModel`` therefore waits to place a model that has fused experts until its
first per-adapter call (or ``_lazy_wrap_model()``, upstream's name), so adapters added before
it may bring expert LoRA. Under expert parallelism each slot's wrapper then adds only the update
of the experts its rank holds, as a single adapter's does (``twinkle.model.expert_parallel``).

A ``ParamWrapper`` runs its active adapters on every token of a forward (PEFT refuses its
mixed-batch ``adapter_names=``). ``rows_by_adapter`` lets one forward give rows of different
adapters their own expert update: the experts module (or a router whose weight carries LoRA)
runs once per adapter, on that adapter's rows, with the slot's wrappers on, exactly as a forward
of those rows alone would run it. The shared decoding batch (``twinkle.sampler.row_adapters``)
and the mixed evaluation batch (``twinkle.model.lora_modes.adapter_per_row``) use it."""

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from twinkle.model.adapters import set_active
from twinkle.model.lora import DEPRECATED_ALIAS
from twinkle.model.slots import is_param_wrapper
from twinkle.utils.errors import UserError

Runs = list[tuple[int, int, str | None]]  # (first row, end row, slot: None for none)


def has_fused_experts(lm: torch.nn.Module) -> bool:
    """Whether ``lm`` holds 3-D expert weights (transformers' fused MoE experts)."""
    return any(p.dim() == 3 for p in lm.parameters())


def attach(lm: Any, slots: list[str], params: list[str], max_r: int, placed: bool) -> None:
    """LoRA of rank ``max_r`` on the parameters ``params`` for each of ``slots`` (PEFT's
    ``inject_adapter_in_model``, parameters only); every new weight trainable. ``UserError`` once
    the model is placed."""
    from peft import LoraConfig, inject_adapter_in_model

    if placed:
        raise UserError(
            f"target_parameters {params}: the model was placed (sharded) without slots on them; add the adapters "
            "that reach the experts before the first training call, or give the slots them from the start: "
            "MultiLoraTransformersModel(..., lora_config=LoraConfig(target_parameters=[...]))"
        )
    # PEFT's tuner writes each injected config into the model's shared ``peft_config`` dict
    # (the slots' configs): kept and put back, so the slots' own configs stay as attached
    shared = lm.peft_config
    kept = dict(shared)
    try:
        for slot in slots:
            config = LoraConfig(
                r=max_r, lora_alpha=max_r, lora_dropout=0.0, target_modules=[], target_parameters=params
            )
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "Already found a `peft_config`", UserWarning)
                warnings.filterwarnings("ignore", DEPRECATED_ALIAS, FutureWarning)
                inject_adapter_in_model(config, lm, adapter_name=slot)
    except ValueError as exc:
        raise UserError(f"cannot put adapter slots on target_parameters {params}: {exc}") from exc
    finally:
        shared.clear()
        shared.update(kept)
        lm.peft_config = shared
    for name, param in lm.named_parameters():
        if ".lora_" in name:
            param.requires_grad_(True)


def wrapper_chains(layers: dict[str, Any]) -> list[list[tuple[str, Any]]]:
    """The ``ParamWrapper`` layers of ``layers`` (key -> layer) by experts module: per module the
    chain (key, wrapper) from the outermost one (the module in the model's tree) inwards, as PEFT
    nests one wrapper per targeted parameter."""
    keys = {id(m): k for k, m in layers.items() if is_param_wrapper(m)}
    inner = {id(m.base_layer) for m in layers.values() if id(m) in keys}
    chains = []
    for layer in layers.values():
        if id(layer) not in keys or id(layer) in inner:
            continue
        chain = []
        while id(layer) in keys:
            chain.append((keys[id(layer)], layer))
            layer = layer.base_layer
        chains.append(chain)
    return chains


@contextlib.contextmanager
def rows_by_adapter(
    layers: dict[str, Any], runs: Runs, targets: dict[str, set[str]], every_slot: bool = False
) -> Iterator[None]:
    """Rows ``start:end`` of each experts module's input run through ``slot``'s wrappers, per
    run; ``targets`` maps a slot to the layer keys it runs on (its wrappers elsewhere stay off, as
    its lone forward leaves them); the last run ends at the batch's last row. Rows of one slot go
    through the module together, once, and rows between runs, or of a slot that reaches none of
    the module's wrappers, through it without adapters. ``every_slot``: the module runs for every
    slot its wrappers hold and for no adapter, in a fixed order, on no tokens where the batch has
    none: the same calls on every rank, as experts that exchange tokens across ranks (expert
    parallelism) need; ``targets`` then names every slot (a rank's experts run the other ranks'
    tokens of each slot). The outermost wrapper of each module gets a forward (an instance
    attribute, removed afterwards) that does this; every wrapper's active adapters are emptied
    after each call. The experts' input holds each row's tokens one row after another
    (transformers' MoE blocks flatten ``(rows, tokens, hidden)``)."""
    chains = wrapper_chains(layers)
    for chain in chains:
        chain[0][1].forward = _grouped_forward(chain, runs, targets, every_slot)
    try:
        yield
    finally:
        for chain in chains:
            del chain[0][1].forward


def _grouped_forward(
    chain: list[tuple[str, Any]], runs: Runs, targets: dict[str, set[str]], every_slot: bool
) -> Any:
    top = chain[0][1]
    forward = type(top).forward
    keys = {key for key, _ in chain}
    # a slot none of whose targets is on this module runs it as no adapter does
    runs = [(s, e, slot if slot is not None and keys & targets[slot] else None) for s, e, slot in runs]
    order = [None, *sorted({slot for _, wrapper in chain for slot in wrapper.lora_A})] if every_slot else []

    def grouped(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        rows = max(end for _, end, _ in runs)
        if x.shape[0] % rows:
            raise UserError(
                f"per-row adapters on expert LoRA: the experts of {chain[0][0]} got {x.shape[0]} tokens for "
                f"{rows} rows; run each adapter's rows in their own call"
            )
        per = x.shape[0] // rows
        groups: dict[str | None, list[int]] = {}
        covered = torch.zeros(x.shape[0], dtype=torch.bool)
        for start, end, slot in runs:
            groups.setdefault(slot, []).extend(range(start * per, end * per))
            covered[start * per : end * per] = True
        if not bool(covered.all()):
            groups.setdefault(None, []).extend(covered.logical_not().nonzero().flatten().tolist())
        if every_slot:
            assert set(groups) <= set(order), (sorted(map(str, groups)), order)
            groups = {slot: groups.get(slot, []) for slot in order}
        parts = []
        for slot, tokens in groups.items():
            index = torch.tensor(tokens, dtype=torch.long, device=x.device)
            for key, wrapper in chain:
                set_active(wrapper, [slot] if slot is not None and key in targets.get(slot, ()) else [])
            try:
                part = forward(top, x[index], *_rows_of(args, index, x), **_rows_of(kwargs, index, x))
            finally:
                for _, wrapper in chain:
                    set_active(wrapper, [])
            parts.append((index, part))
        return _joined(parts, x.shape[0])

    return grouped


def _joined(parts: list[tuple[torch.Tensor, Any]], tokens: int) -> Any:
    """The module's output for all ``tokens``, from each group's ``(its tokens, its output)``: a
    tensor over the tokens, or a tuple of them (a router's logits, weights and choices)."""
    first = parts[0][1]
    if isinstance(first, tuple):
        return tuple(_joined([(i, p[k]) for i, p in parts], tokens) for k in range(len(first)))
    out = first.new_empty((tokens, *first.shape[1:]))
    for index, part in parts:
        out.index_copy_(0, index, part)
    return out


def _rows_of(values: Any, index: torch.Tensor, x: torch.Tensor) -> Any:
    """The tokens ``index`` of each tensor among ``values`` (a tuple or dict) laid out as ``x``
    (the same first dimension); everything else as it is (a routing table, a flag)."""

    def pick(v: Any) -> Any:
        return v[index] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == x.shape[0] else v

    if isinstance(values, dict):
        return {k: pick(v) for k, v in values.items()}
    return tuple(pick(v) for v in values)
