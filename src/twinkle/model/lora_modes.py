"""Evaluation with the LoRA adapters off (``forward_only(disable_lora=True)``, which then runs the
plain evaluation's supervised-rows path), or with each row of a batch through its own adapter and
the per-token log-probabilities such a pass returns (``forward_only(adapter_names=[...])``).

Both modes set PEFT's per-layer flags directly and put them back after the pass: PEFT's own
``disable_adapter()`` / ``set_adapter`` also switch the adapters' ``requires_grad``, which would
change what the optimizer and FSDP2 see. The fused LoRA nodes stand aside for a mixed batch, as
they take one adapter only. A mixed batch runs packed where the plain evaluation would
(``adapter_per_span``): the samples end to end in one row (the consecutive samples of one adapter
after their shared prefix, held once), each LoRA layer computing the frozen product once for every
token and each adapter's rank-r product on its own samples' tokens only (segmented LoRA, as S-LoRA
and Punica serve many adapters). A batch that cannot be packed (a model
family without packed attention, a padding-aware model) or LoRA layers other than plain linear
ones run PEFT's mixed-batch forward (``adapter_per_row``: ``adapter_names=`` on each LoRA layer,
the rows of each adapter gathered and computed together). With the adapters off, the plain LoRA
linears compute their frozen product through ``cpu_gemm`` as the fused nodes do."""

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from twinkle.kernel.cpu_gemm import linear
from twinkle.kernel.lora.segments import add_segments
from twinkle.model.adapters import set_active
from twinkle.model.expert_parallel import expert_parallel_of
from twinkle.model.forward import causal_lm_of, loss_and_view
from twinkle.model.outputs import label_logps
from twinkle.model.packing import pack, row_groups, scored_lengths, shifted_targets
from twinkle.model.slot_experts import Runs, rows_by_adapter
from twinkle.model.slots import is_param_wrapper
from twinkle.utils.modules import modules

BASE_ROW = "__base__"  # PEFT's name for a row without adapter in a mixed batch


def lora_layers(model: Any) -> list[Any]:
    from peft.tuners.lora import LoraLayer

    return [m for m in modules(model) if isinstance(m, LoraLayer)]


@contextlib.contextmanager
def adapters_off(model: Any) -> Iterator[None]:
    """Every LoRA layer computes its base layer only (the base model's outputs); the plain
    ones through ``cpu_gemm``'s linear, the frozen product of the fused nodes."""
    layers = lora_layers(model)
    saved = [layer._disable_adapters for layer in layers]
    plain = can_segment(layers)
    for layer in layers:
        layer._disable_adapters = True
        if plain:
            layer.forward = _segmented_forward(layer, [])  # an instance attribute, removed below
    try:
        yield
    finally:
        for layer, flag in zip(layers, saved, strict=True):
            layer._disable_adapters = flag
            if plain:
                del layer.forward


@contextlib.contextmanager
def adapter_per_row(model: Any, names: Sequence[str]) -> Iterator[None]:
    """Row i of every LoRA layer's input runs through PEFT adapter ``names[i]`` (``BASE_ROW``:
    none). The layers' active adapters are emptied meanwhile, so no fused node takes the call.
    LoRA on a parameter (PEFT's ``ParamWrapper``: an MoE model's fused experts), which adds one
    adapter's update for a whole forward, runs its module once per adapter on that adapter's rows
    instead (``slot_experts.rows_by_adapter``), each adapter on the wrappers that hold it; under
    expert parallelism every rank runs it for every adapter, on no rows where it has none."""
    layers = lora_layers(model)
    saved = [layer.active_adapters for layer in layers]
    names = list(names)
    wrapped = any(is_param_wrapper(layer) for layer in layers)
    experts = {k: m for k, m in model.named_modules() if is_param_wrapper(m)} if wrapped else {}

    def inject(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, {**kwargs, "adapter_names": names}

    hooks = [
        layer.register_forward_pre_hook(inject, with_kwargs=True)
        for layer in layers
        if not is_param_wrapper(layer)
    ]
    for layer in layers:
        set_active(layer, [])
    runs = _row_runs(names)
    # every adapter the wrappers hold, not only this batch's: under expert parallelism a rank's
    # experts run the other ranks' tokens of each adapter too
    held = {slot for m in experts.values() for slot in m.lora_A}
    targets = {slot: {k for k, m in experts.items() if slot in m.lora_A} for slot in held}
    # under expert parallelism the experts exchange tokens: every rank makes the same calls
    every_slot = expert_parallel_of(causal_lm_of(model)) is not None
    try:
        with rows_by_adapter(experts, runs, targets, every_slot) if experts else contextlib.nullcontext():
            yield
    finally:
        for hook in hooks:
            hook.remove()
        for layer, active in zip(layers, saved, strict=True):
            set_active(layer, active)


def _row_runs(names: list[str]) -> Runs:
    """``(first row, end row, adapter)`` of each run of equal ``names`` (None for ``BASE_ROW``)."""
    runs: Runs = []
    for row, name in enumerate(names):
        slot = None if name == BASE_ROW else name
        if runs and runs[-1][2] == slot:
            runs[-1] = (runs[-1][0], row + 1, slot)
        else:
            runs.append((row, row + 1, slot))
    return runs


def token_runs(batch: dict[str, torch.Tensor], names: Sequence[str]) -> list[tuple[int, int, str]] | None:
    """``(start, end, adapter)`` of the packed row's tokens that each adapter computes, for the
    row ``pack(batch, share_prefix=names)`` builds: each run of consecutive samples of one adapter,
    their shared prefix included, is one run (``BASE_ROW`` samples get none); None when the batch
    does not pack."""
    packed = pack(batch, share_prefix=names)
    if packed is None:
        return None
    kept = [
        i
        for i, n in enumerate(scored_lengths(shifted_targets(batch["labels"], batch["attention_mask"])))
        if n
    ]
    spans = packed["twinkle_segments"].spans
    runs: list[tuple[int, int, str]] = []
    first, start = 0, 0
    for group in row_groups(kept, names):  # laid out one after the other, each prefix first
        end = spans[first + len(group) - 1][1]
        if names[group[0]] != BASE_ROW:
            runs.append((start, end, names[group[0]]))
        first, start = first + len(group), end
    return runs


def _segmented_forward(layer: Any, runs: list[tuple[int, int, str]]) -> Any:
    """``layer`` (a PEFT ``lora.Linear``, eval mode: no dropout) on a packed row: the base product
    for every token, then each run's adapter product on the run's tokens only: one adapter's
    rank-r work per token whatever the number of adapters, and no per-token mask to build. The
    runs' products go to one call of ``lora_segments``'s C kernel where it takes them (fp32 CPU),
    else two torch products per run."""
    base = layer.base_layer

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = linear(flat, base.weight, base.bias)
        # read at the call: under FSDP2 the layer holds its gathered weights only in its forward
        weights = [
            (s, e, layer.lora_A[n].weight, layer.lora_B[n].weight, layer.scaling[n]) for s, e, n in runs
        ]
        if weights and add_segments(out, flat.contiguous(), weights):  # every run in one C call
            return out.view(*x.shape[:-1], out.shape[-1])
        for start, end, name in runs:
            lora_a, lora_b = layer.lora_A[name].weight, layer.lora_B[name].weight
            low = flat[start:end].to(lora_a.dtype) @ lora_a.t()
            if lora_a.dtype == out.dtype:
                out[start:end].addmm_(low, lora_b.t(), alpha=layer.scaling[name])
            else:  # an adapter wider than the base: its product rounded once, as PEFT does
                out[start:end] += (torch.mm(low, lora_b.t()) * layer.scaling[name]).to(out.dtype)
        return out.view(*x.shape[:-1], out.shape[-1])

    return forward


def can_segment(layers: list[Any]) -> bool:
    """Every LoRA layer is a plain PEFT ``lora.Linear`` (or the fused subclass) over an
    ``nn.Linear``, unmerged, without DoRA or a LoRA bias: what ``adapter_per_span`` computes
    (other layers run ``adapter_per_row``)."""
    from peft.tuners.lora.layer import Linear as PeftLoraLinear

    return all(
        isinstance(layer, PeftLoraLinear)
        and type(layer.base_layer) is torch.nn.Linear
        and not layer.merged
        and not any(layer.use_dora.values())
        and not any(getattr(layer, "lora_bias", {}).values())
        for layer in layers
    )


@contextlib.contextmanager
def adapter_per_span(layers: list[Any], runs: list[tuple[int, int, str]]) -> Iterator[None]:
    """The LoRA ``layers`` (``lora_layers``) compute a packed row as ``runs`` (``token_runs``)
    say; their active adapters are emptied meanwhile, so no fused node takes the call."""
    saved = [layer.active_adapters for layer in layers]
    for layer in layers:
        layer.forward = _segmented_forward(layer, runs)  # an instance attribute, removed below
        set_active(layer, [])
    try:
        yield
    finally:
        for layer, active in zip(layers, saved, strict=True):
            del layer.forward
            set_active(layer, active)


def loss_and_logps(model: Any, batch: dict[str, torch.Tensor], loss_fn: Any) -> tuple[Any, torch.Tensor]:
    """One unpacked pass over ``batch`` (rows stay rows, so each keeps its adapter): ``loss_fn``'s
    ``LossOutput`` and each label's log-probability, ``(B, L)`` aligned with ``batch["labels"]``
    (0 where a label is -100 or has no prediction: the first position, pads). The pass is the
    plain eval's (``loss_and_view``): a head loss gets the head on the supervised rows only, so no
    ``(B, L, vocab)`` logits are built for it."""
    out, view = loss_and_view(model, batch, loss_fn, padding_free=False)
    return out, label_logps(out, view, batch, lazy=False)
