"""Adapter slots: ``max_loras`` PEFT LoRA adapters of rank ``max_r`` prepared once on a model, each
lent to one user adapter of rank ``r <= max_r`` at a time.

A user adapter of rank r uses rows ``A[:r]`` and columns ``B[:, :r]`` of its slot's matrices (on
an expert parameter, PEFT's ``ParamWrapper``, the same rank-r part of every expert's factors:
``Part``); the rest stays zero, so the slot computes exactly the rank-r product (the zero rows and
columns add zeros and get zero gradients). Its scaling and dropout are set on each layer, and the layers
outside its target modules keep the slot's weights at zero and run without it (their active
adapter list is empty), so it has no effect and no gradient there. A free slot is all zero and
off everywhere (``SlotTable._free``): every slot from the start, and each one given back.

Under FSDP2 the slot weights are sharded DTensors: every write of values builds the full tensor on
every rank the same way and copies this rank's shard of it (a zero is written to the shard alone);
every read gathers the full tensor (a collective: all ranks call the same reads in the same
order)."""

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from twinkle.model.adapters import set_active
from twinkle.model.train_state import stream_seed
from twinkle.utils.errors import UserError

SLOT_PREFIX = "slot-"


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (gathered when it is a sharded DTensor)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@torch.no_grad()
def zero(param: torch.Tensor) -> None:
    """Set ``param`` to zero (this rank's shard when sharded)."""
    (param.to_local() if hasattr(param, "to_local") else param).zero_()


@torch.no_grad()
def write_full(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set ``param`` to the full-size ``value`` (this rank's shard of it when sharded)."""
    if hasattr(param, "to_local"):
        from torch.distributed.tensor import distribute_tensor

        local = param.to_local()
        shard = distribute_tensor(
            value.to(local.device, local.dtype), param.device_mesh, param.placements, src_data_rank=None
        )
        local.copy_(shard.to_local())
    else:
        param.copy_(value.to(param.device, param.dtype))


@dataclass(frozen=True)
class Part:
    """The part of a slot weight an adapter uses, as the weight a plain PEFT adapter of its rank
    holds: the slot weight viewed as ``view``, indexed by ``index``, reshaped to ``shape``."""

    view: tuple[int, ...]
    index: tuple[slice, ...]
    shape: tuple[int, ...]

    def of(self, weight: torch.Tensor) -> torch.Tensor:
        """The adapter's weight (a copy where the part is not contiguous)."""
        return weight.reshape(self.view)[self.index].reshape(self.shape)

    def put(self, weight: torch.Tensor, value: torch.Tensor) -> None:
        """Write ``value`` (of ``shape``) into the part of ``weight`` (a contiguous tensor)."""
        target = weight.view(self.view)[self.index]
        target.copy_(value.reshape(target.shape))


@dataclass(frozen=True)
class Target:
    """How an adapter uses one slot layer: its rank and scaling there (PEFT's ``rank_pattern`` /
    ``alpha_pattern`` may give a layer its own), and ``saved``, the module path its weights have
    in a PEFT adapter file (``base_model.model.{saved}.lora_A.weight``)."""

    r: int
    scaling: float
    saved: str


def is_param_wrapper(layer: Any) -> bool:
    """PEFT's LoRA on one parameter (``target_parameters``), e.g. an MoE layer's fused experts."""
    return hasattr(layer, "parameter_name") and hasattr(layer, "get_param")


def layer_key(key: str, layer: Any) -> str:
    """The name an adapter's config reaches ``layer`` (at module ``key``) by: the module's key, or
    for a ``ParamWrapper`` (PEFT nests one per targeted parameter of a module) the module's own
    key, without the wrappers' ``.base_layer``, and the parameter's name."""
    if is_param_wrapper(layer):
        return f"{key.replace('.base_layer', '')}.{layer.parameter_name}"
    return key


def parts(layer: Any, slot: str, r: int) -> tuple[Part, Part]:
    """The parts of ``layer``'s slot ``(lora_A, lora_B)`` weights that a rank-r adapter uses: rows
    ``A[:r]`` and columns ``B[:, :r]``; on a ``ParamWrapper`` of E experts, whose A holds E blocks
    of R rows (``(E, R, in)``) and whose B's columns run rank-major (``(out, R, E)``), the first r
    of each expert's rows and columns, laid out as a rank-r wrapper lays them out."""
    a, b = layer.lora_A[slot].weight, layer.lora_B[slot].weight
    if not is_param_wrapper(layer):
        return (
            Part(tuple(a.shape), (slice(0, r),), (r, a.shape[1])),
            Part(tuple(b.shape), (slice(None), slice(0, r)), (b.shape[0], r)),
        )
    experts = layer.num_experts
    rank = a.shape[0] // experts
    return (
        Part((experts, rank, a.shape[1]), (slice(None), slice(0, r)), (experts * r, a.shape[1])),
        Part((b.shape[0], rank, experts), (slice(None), slice(0, r)), (b.shape[0], r * experts)),
    )


def slot_rank(layer: Any, slot: str) -> int:
    """The rank a slot has on ``layer`` (``max_r``; twice it on a fused gate/up PEFT maps two
    modules' LoRA onto)."""
    return layer.r[slot]


def lora_scaling(config: Any) -> float:
    """PEFT's scaling of a LoRA config: ``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA."""
    root = math.sqrt(config.r) if getattr(config, "use_rslora", False) else config.r
    return config.lora_alpha / root


def _dropout(p: float) -> nn.Module:
    return nn.Dropout(p) if p > 0 else nn.Identity()


class SlotTable:
    """The slots' LoRA layers of one PEFT model and which slot each adapter holds.

    ``layers`` maps each layer's key (``layer_key``: relative to the causal LM, as PEFT matches
    target modules and parameters) to its ``LoraLayer``, in the model's module order; the order
    fixes the order of every collective and of each adapter's optimizer parameters."""

    def __init__(self, lm: nn.Module, max_loras: int, max_r: int):
        self.max_r = max_r
        self.names = [f"{SLOT_PREFIX}{i}" for i in range(max_loras)]
        self.layers: dict[str, Any] = {}
        self.holder: dict[str, str] = {}  # adapter name -> slot name
        self.targets: dict[str, list[str]] = {}  # adapter name -> its layer keys, in model order
        self.ranks: dict[str, int] = {}  # adapter name -> its config's rank r
        self.layout: dict[str, dict[str, Target]] = {}  # adapter name -> layer key -> its use of it
        self.refresh(lm)

    def refresh(self, lm: nn.Module) -> None:
        """Take the slots' layers of ``lm`` again (slots attached since are free on them)."""
        from peft.tuners.lora import LoraLayer

        found = {
            layer_key(k, m): m
            for k, m in lm.named_modules()
            if isinstance(m, LoraLayer) and self.names[0] in m.lora_A
        }
        new = [k for k in found if k not in self.layers]
        self.layers = found
        for slot in self.names:
            self._free(slot, new)

    # ---------------------------------------------------------------- lending
    def free(self) -> list[str]:
        taken = set(self.holder.values())
        return [s for s in self.names if s not in taken]

    def acquire(self, name: str, config: Any, layout: dict[str, Target], seed: int) -> str:
        """Lend the first free slot to adapter ``name`` (its LoRA ``config``, using the layers of
        ``layout``) and initialise it from the adapter's own generator: A's part as PEFT
        initialises LoRA A (Kaiming-uniform, ``a = sqrt(5)``, over the part's shape), every other
        weight zero. The draws depend only on (``seed``, ``name``), so a slot starts the same
        whichever it is and whatever ran before. ``UserError`` when every slot is taken."""
        free = self.free()
        if not free:
            raise UserError(
                f"all {len(self.names)} slots are taken ({', '.join(self.holder)}); "
                f"remove_adapter(...) one or raise max_loras= (now {len(self.names)})"
            )
        slot = free[0]
        generator = torch.Generator().manual_seed(stream_seed(seed, name, "lora-init"))
        for key, layer in self.layers.items():
            a, b = layer.lora_A[slot].weight, layer.lora_B[slot].weight
            new_a = torch.zeros(a.shape, dtype=torch.float32)
            if key in layout:
                a_part, _ = parts(layer, slot, layout[key].r)
                part = torch.empty(a_part.shape, dtype=torch.float32)
                nn.init.kaiming_uniform_(part, a=math.sqrt(5), generator=generator)
                a_part.put(new_a, part)
                layer.scaling[slot] = layout[key].scaling
                if not is_param_wrapper(layer):  # PEFT's expert LoRA has no dropout
                    layer.lora_dropout[slot] = _dropout(float(config.lora_dropout or 0.0))
            write_full(a, new_a)
            write_full(b, torch.zeros(b.shape))
        self.holder[name] = slot
        self.targets[name] = [k for k in self.layers if k in layout]
        self.ranks[name] = config.r
        self.layout[name] = dict(layout)
        return slot

    def release(self, name: str) -> None:
        """Give adapter ``name``'s slot back (``_free``)."""
        slot = self.holder.pop(name)
        self.targets.pop(name)
        self.ranks.pop(name)
        self.layout.pop(name)
        self._free(slot)

    def _free(self, slot: str, keys: list[str] | None = None) -> None:
        """A free slot (on the layers ``keys``, default all): every weight zero without gradient,
        no dropout, scaling 1, off on every layer; it computes and learns nothing until it is lent."""
        for key in self.layers if keys is None else keys:
            layer = self.layers[key]
            for p in (layer.lora_A[slot].weight, layer.lora_B[slot].weight):
                zero(p)
                p.grad = None
            layer.scaling[slot] = 1.0
            layer.lora_dropout[slot] = nn.Identity()
            if slot in layer.active_adapters:
                set_active(layer, [])

    # ---------------------------------------------------------------- running
    def activate(self, name: str | None) -> None:
        """Adapter ``name`` runs on its target layers and nothing runs elsewhere (None: no adapter
        anywhere), set on each layer by ``twinkle.model.adapters.set_active``."""
        on = set(self.targets[name]) if name is not None else set()
        slot = [self.holder[name]] if name is not None else []
        for key, layer in self.layers.items():
            set_active(layer, slot if key in on else [])

    def parameters(self, name: str) -> Iterator[tuple[torch.nn.Parameter, Part]]:
        """Each (slot weight, the part of it the adapter uses), over its target layers in model
        order, A before B."""
        slot = self.holder[name]
        for key in self.targets[name]:
            layer = self.layers[key]
            a_part, b_part = parts(layer, slot, self.layout[name][key].r)
            yield layer.lora_A[slot].weight, a_part
            yield layer.lora_B[slot].weight, b_part

    def named_parameters(self, name: str, model: nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """(model parameter name, parameter) of every weight of the adapter's slot."""
        mark = f".{self.holder[name]}."
        return ((n, p) for n, p in model.named_parameters() if mark in n)

    # ---------------------------------------------------------------- files
    def _files(self, name: str) -> Iterator[tuple[str, torch.nn.Parameter, Part]]:
        """(saved name, slot weight, part) of each tensor of the adapter's PEFT file."""
        slot = self.holder[name]
        for key in self.targets[name]:
            layer, target = self.layers[key], self.layout[name][key]
            a_part, b_part = parts(layer, slot, target.r)
            yield f"base_model.model.{target.saved}.lora_A.weight", layer.lora_A[slot].weight, a_part
            yield f"base_model.model.{target.saved}.lora_B.weight", layer.lora_B[slot].weight, b_part

    def export(self, name: str) -> dict[str, torch.Tensor]:
        """The adapter alone under PEFT's saved names: the parts it uses of its target layers,
        full size on the CPU (a collective under FSDP)."""
        return {k: part.of(full(w)).detach().cpu().contiguous() for k, w, part in self._files(name)}

    def export_names(self, name: str) -> Iterator[tuple[str, tuple[int, ...]]]:
        """(saved name, shape) of each tensor ``export`` writes for the adapter."""
        return ((k, part.shape) for k, _, part in self._files(name))

    def load(self, name: str, tensors: dict[str, torch.Tensor]) -> list[str]:
        """Write saved ``export`` tensors into the adapter's slot (the rest stays zero). Returns
        the problems (a name missing, or of another shape); nothing is written unless none."""
        expected = list(self.export_names(name))
        problems = [
            f"{k} {'missing' if k not in tensors else f'of shape {tuple(tensors[k].shape)}, not {shape}'}"
            for k, shape in expected
            if k not in tensors or tuple(tensors[k].shape) != shape
        ]
        if problems:
            return problems
        for key, param, part in self._files(name):
            value = torch.zeros(param.shape, dtype=torch.float32)
            part.put(value, tensors[key].float())
            write_full(param, value)
        return []
