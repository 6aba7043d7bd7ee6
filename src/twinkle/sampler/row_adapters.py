"""``SlotRowAdapters``: the adapters of a ``MultiLoraTransformersModel``'s slots as a shared
decoding batch (``twinkle.sampler.batch``) runs them, each row of a step through its own adapter.

``one(name)`` runs one adapter on every row, by activating it as a lone sample does, so a
request's prefill, and every step of a batch whose rows all share an adapter, is the lone
sample's computation. ``rows(runs)`` gives each LoRA layer a forward for the step (an instance
attribute, removed afterwards) that computes the frozen product once for every row and then each
adapter's rank-r product on its own rows only (segmented LoRA, as S-LoRA and Punica serve many
adapters). Where several adapters meet in a layer, their products go to one call of call op
``lora_segments`` (``twinkle.kernel.lora.segments``: fp32 CPU tensors; two library calls per
adapter and layer would cost more than their arithmetic), another summation order than a lone
sample's; elsewhere a run's product is the lone sample's own (the same module forwards on the
same rows, added the same way). Either way a row's output differs from its lone run's by
summation order at most. Each layer adds only the runs of adapters that target it: a slot is
zero elsewhere and a lone sample runs no adapter there. LoRA on a mixture-of-experts model's fused
experts (PEFT's ``ParamWrapper``, which adds one adapter's update to the expert weights for a
whole forward) runs the experts once per adapter on that adapter's rows
(``twinkle.model.slot_experts.rows_by_adapter``), as a lone sample of those rows runs them. The
layers' active adapters are emptied meanwhile, so no fused node takes the call, and put back
afterwards: training between decoding chunks finds them as it left them."""

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from twinkle.kernel.lora.segments import add_segments
from twinkle.model.adapters import set_active
from twinkle.model.expert_parallel import expert_parallel_of
from twinkle.model.forward import causal_lm_of
from twinkle.model.slot_experts import rows_by_adapter
from twinkle.model.slots import is_param_wrapper
from twinkle.sampler import linears
from twinkle.utils.errors import UserError
from twinkle.utils.modules import set_training

Run = tuple[int, int, str]  # (first row, end row, adapter name)


class SlotRowAdapters:
    """What ``DecodeBatch`` asks of a model's adapters, for ``model`` (a
    ``MultiLoraTransformersModel``; adapter names are its adapters')."""

    def __init__(self, model: Any):
        self.model = model
        self.lm = causal_lm_of(model.model)

    @contextlib.contextmanager
    def decoding_chunk(self) -> Iterator[None]:
        """A decoding chunk: eval mode (the model's next ``forward`` turns training mode back on)
        and, on the CPU in one process, the plain linear layers routed to the decoding products,
        as a lone sample runs them (``twinkle.sampler.linears``)."""
        model = self.model
        set_training(model.model, False)
        model._in_train_mode = False
        routed = model.device.type == "cpu" and not model.runtime.is_distributed
        with linears.routed(self.lm) if routed else contextlib.nullcontext():
            yield

    @contextlib.contextmanager
    def one(self, name: str) -> Iterator[None]:
        """Adapter ``name`` on every row (activated as a lone sample activates it)."""
        self.model.adapters.activate(name)
        yield

    @contextlib.contextmanager
    def rows(self, runs: list[Run]) -> Iterator[None]:
        """Rows ``start:end`` of every LoRA layer's input through adapter ``name``, per run."""
        table = self.model.slots
        if expert_parallel_of(self.lm) is not None and any(map(is_param_wrapper, table.layers.values())):
            # each rank's experts would run the other ranks' rows of every slot, which these
            # calls do not make alike on every rank (the mixed evaluation's every_slot does)
            raise UserError(
                "rows of several adapters in one decoding batch on expert slots under expert parallelism "
                "are not supported; sample each adapter's rows in their own call"
            )
        targets = {name: set(table.targets[name]) for _, _, name in runs}
        saved = []
        for key, layer in table.layers.items():
            saved.append((layer, layer.active_adapters))
            set_active(layer, [])
            if is_param_wrapper(layer):  # the experts: slot_experts.rows_by_adapter below
                continue
            mine = [(s, e, table.holder[n], table.ranks[n]) for s, e, n in runs if key in targets[n]]
            layer.forward = _rows_forward(layer, mine)  # an instance attribute, removed below
        slots = [(s, e, table.holder[n]) for s, e, n in runs]
        try:
            with rows_by_adapter(table.layers, slots, {table.holder[n]: t for n, t in targets.items()}):
                yield
        finally:
            for layer, active in saved:
                layer.__dict__.pop("forward", None)
                set_active(layer, active)


def _rows_forward(layer: Any, runs: list[tuple[int, int, str, int]]) -> Any:
    """``layer``'s forward for one decoding step: its base layer's forward on every row, plus each
    run ``(start, end, slot, rank)``'s ``scaling * B(A(x))`` on the run's rows: all runs in one
    ``add_segments`` call where there are several and it takes them, else the slot's modules' own
    forwards run by run."""
    base = layer.base_layer

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = base.forward(x)
        flat_x = x.reshape(-1, x.shape[-1])
        flat = out.reshape(-1, out.shape[-1])
        if len(runs) > 1:
            weights = [
                (s, e, layer.lora_A[slot].weight[:r], layer.lora_B[slot].weight[:, :r], layer.scaling[slot])
                for s, e, slot, r in runs
            ]
            if add_segments(flat, flat_x.contiguous(), weights):
                return flat.view(out.shape)
        for start, end, slot, _ in runs:
            lora_a, lora_b = layer.lora_A[slot], layer.lora_B[slot]
            low = lora_a.forward(flat_x[start:end].to(lora_a.weight.dtype))
            flat[start:end] += (lora_b.forward(low) * layer.scaling[slot]).to(out.dtype)
        return flat.view(out.shape)

    return forward
