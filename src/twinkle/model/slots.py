"""Adapter slots: ``max_loras`` PEFT LoRA adapters of rank ``max_r`` prepared once on a model, each
lent to one user adapter of rank ``r <= max_r`` at a time.

A user adapter of rank r uses rows ``A[:r]`` and columns ``B[:, :r]`` of its slot's matrices; the
rest stays zero, so the slot computes exactly the rank-r product (the zero rows and columns add
zeros and get zero gradients). Its scaling and dropout are set on each layer, and the layers
outside its target modules keep the slot's weights at zero and run without it (their active
adapter list is empty), so it has no effect and no gradient there. A free slot is all zero and
off everywhere (``SlotTable._free``): every slot from the start, and each one given back.

Under FSDP2 the slot weights are sharded DTensors: every write of values builds the full tensor on
every rank the same way and copies this rank's shard of it (a zero is written to the shard alone);
every read gathers the full tensor (a collective: all ranks call the same reads in the same
order)."""

import math
from collections.abc import Iterator
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


def rank_slices(r: int) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
    """The parts of a slot's ``(lora_A, lora_B)`` weights that a rank-r adapter uses."""
    return (slice(0, r),), (slice(None), slice(0, r))


def lora_scaling(config: Any) -> float:
    """PEFT's scaling of a LoRA config: ``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA."""
    root = math.sqrt(config.r) if getattr(config, "use_rslora", False) else config.r
    return config.lora_alpha / root


def _dropout(p: float) -> nn.Module:
    return nn.Dropout(p) if p > 0 else nn.Identity()


class SlotTable:
    """The slots' LoRA layers of one PEFT model and which slot each adapter holds.

    ``layers`` maps each module key (relative to the causal LM, as PEFT matches target modules)
    to its ``LoraLayer``, in the model's module order; the order fixes the order of every
    collective and of each adapter's optimizer parameters."""

    def __init__(self, lm: nn.Module, max_loras: int, max_r: int):
        from peft.tuners.lora import LoraLayer

        self.max_r = max_r
        self.names = [f"{SLOT_PREFIX}{i}" for i in range(max_loras)]
        self.layers = {
            k: m for k, m in lm.named_modules() if isinstance(m, LoraLayer) and self.names[0] in m.lora_A
        }
        self.holder: dict[str, str] = {}  # adapter name -> slot name
        self.targets: dict[str, list[str]] = {}  # adapter name -> its module keys, in model order
        self.ranks: dict[str, int] = {}  # adapter name -> its rank r
        for slot in self.names:
            self._free(slot)

    # ---------------------------------------------------------------- lending
    def free(self) -> list[str]:
        taken = set(self.holder.values())
        return [s for s in self.names if s not in taken]

    def acquire(self, name: str, config: Any, targets: list[str], seed: int) -> str:
        """Lend the first free slot to adapter ``name`` (its LoRA ``config`` on module keys
        ``targets``) and initialise it from the adapter's own generator: ``A[:r]`` as PEFT
        initialises LoRA A (Kaiming-uniform, ``a = sqrt(5)``), every other weight zero. The draws
        depend only on (``seed``, ``name``), so a slot starts the same whichever it is and
        whatever ran before. ``UserError`` when every slot is taken."""
        free = self.free()
        if not free:
            raise UserError(
                f"all {len(self.names)} slots are taken ({', '.join(self.holder)}); "
                f"remove_adapter(...) one or raise max_loras= (now {len(self.names)})"
            )
        slot = free[0]
        generator = torch.Generator().manual_seed(stream_seed(seed, name, "lora-init"))
        chosen = set(targets)
        for key, layer in self.layers.items():
            a, b = layer.lora_A[slot].weight, layer.lora_B[slot].weight
            new_a = torch.zeros(a.shape, dtype=torch.float32)
            if key in chosen:
                part = torch.empty(config.r, a.shape[1], dtype=torch.float32)
                nn.init.kaiming_uniform_(part, a=math.sqrt(5), generator=generator)
                new_a[: config.r] = part
                layer.scaling[slot] = lora_scaling(config)
                layer.lora_dropout[slot] = _dropout(float(config.lora_dropout or 0.0))
            write_full(a, new_a)
            write_full(b, torch.zeros(b.shape))
        self.holder[name] = slot
        self.targets[name] = [k for k in self.layers if k in chosen]
        self.ranks[name] = config.r
        return slot

    def release(self, name: str) -> None:
        """Give adapter ``name``'s slot back (``_free``)."""
        slot = self.holder.pop(name)
        self.targets.pop(name)
        self.ranks.pop(name)
        self._free(slot)

    def _free(self, slot: str) -> None:
        """A free slot: every weight zero without gradient, no dropout, scaling 1, off on every
        layer; it computes and learns nothing until it is lent."""
        for layer in self.layers.values():
            for p in (layer.lora_A[slot].weight, layer.lora_B[slot].weight):
                zero(p)
                p.grad = None
            layer.scaling[slot] = 1.0
            layer.lora_dropout[slot] = nn.Identity()
            if slot in layer.active_adapters:
                set_active(layer, [])

    # ---------------------------------------------------------------- running
    def activate(self, name: str | None) -> None:
        """Adapter ``name`` runs on its target modules and nothing runs elsewhere (None: no adapter
        anywhere), set on each layer by ``twinkle.model.adapters.set_active``."""
        on = set(self.targets[name]) if name is not None else set()
        slot = [self.holder[name]] if name is not None else []
        for key, layer in self.layers.items():
            set_active(layer, slot if key in on else [])

    def parameters(self, name: str) -> Iterator[tuple[torch.nn.Parameter, tuple[slice, ...]]]:
        """Each (slot weight, the part of it the adapter uses), over its target modules in model
        order, A before B."""
        slot = self.holder[name]
        a_part, b_part = rank_slices(self.ranks[name])
        for key in self.targets[name]:
            layer = self.layers[key]
            yield layer.lora_A[slot].weight, a_part
            yield layer.lora_B[slot].weight, b_part

    def named_parameters(self, name: str, model: nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """(model parameter name, parameter) of every weight of the adapter's slot."""
        mark = f".{self.holder[name]}."
        return ((n, p) for n, p in model.named_parameters() if mark in n)

    # ---------------------------------------------------------------- files
    def export(self, name: str) -> dict[str, torch.Tensor]:
        """The adapter alone under PEFT's saved names: ``A[:r]``, ``B[:, :r]`` of its target
        modules, full size on the CPU (a collective under FSDP)."""
        slot, out = self.holder[name], {}
        a_part, b_part = rank_slices(self.ranks[name])
        for key in self.targets[name]:
            layer = self.layers[key]
            for kind, part in (("lora_A", a_part), ("lora_B", b_part)):
                weight = full(getattr(layer, kind)[slot].weight)
                out[f"base_model.model.{key}.{kind}.weight"] = weight[part].detach().cpu().contiguous()
        return out

    def export_names(self, name: str) -> Iterator[tuple[str, tuple[int, ...]]]:
        """(saved name, shape) of each tensor ``export`` writes for the adapter."""
        r = self.ranks[name]
        for key in self.targets[name]:
            a, b = (
                getattr(self.layers[key], kind)[self.holder[name]].weight for kind in ("lora_A", "lora_B")
            )
            yield f"base_model.model.{key}.lora_A.weight", (r, a.shape[1])
            yield f"base_model.model.{key}.lora_B.weight", (b.shape[0], r)

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
        slot = self.holder[name]
        for key in self.targets[name]:
            layer = self.layers[key]
            for kind in ("lora_A", "lora_B"):
                saved = tensors[f"base_model.model.{key}.{kind}.weight"]
                param = getattr(layer, kind)[slot].weight
                value = torch.zeros(param.shape, dtype=torch.float32)
                value[tuple(slice(0, n) for n in saved.shape)] = saved.float()
                write_full(param, value)
        return []
