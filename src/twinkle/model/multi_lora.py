"""``MultiLoraTransformersModel``: several LoRA adapters trained on one copy of a base model, and
``SlotAdapters``, the ``twinkle.model.adapters.Adapters`` that holds them.

The base is loaded once and ``max_loras`` adapter slots (``twinkle.model.slots``) are attached
before any FSDP2 wrapping, so adapters can come and go under FSDP2: ``add_adapter_to_model``
lends a free slot to an adapter of rank ``r <= max_r``, ``remove_adapter`` gives it back. Each
adapter has its own ``OptimizerGroup`` (optimizer over its rank-r weights, schedule, loss,
template, metrics, checkpoints), named by ``adapter_name=`` in every per-adapter call.

One adapter is active per forward/backward (time-sharing). Switching sets the slot's layers,
and moves the global torch RNG to the incoming adapter's own stream (the outgoing one's state is
kept in its group), so each adapter draws the same dropout masks whatever else trains. Gradients
live on each slot's own weights, so accumulation windows of different adapters may interleave."""

import copy
import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from twinkle.checkpoint import integrity, layout
from twinkle.model.adapters import Adapters, Build
from twinkle.model.forward import causal_lm_of
from twinkle.model.lora import add_lora
from twinkle.model.slot_optimizer import SlotOptimizer
from twinkle.model.slots import SLOT_PREFIX, SlotTable
from twinkle.model.step import restore_grad
from twinkle.model.train_state import stream_seed
from twinkle.model.transformers_model import TransformersModel
from twinkle.runtime.remote import remote_class  # remote_group= hook
from twinkle.utils.errors import UserError

DEFAULT_TARGETS = "all-linear"  # the targets of a single adapter by default (``--target-modules``)
_SLOT_NAME = re.compile(rf"\.{SLOT_PREFIX}\d+\.")


@remote_class  # remote_group=: built on a device group's ranks (twinkle.runtime.remote)
class MultiLoraTransformersModel(TransformersModel):
    """``TransformersModel`` with ``max_loras`` adapter slots of rank ``max_r`` (``SlotAdapters``).

    ``target_modules``: the slots' modules (default ``all-linear``); each adapter's
    ``target_modules`` must be among them. ``max_length``: the default ``max_length`` of the
    templates ``set_template`` builds. Other keywords are ``TransformersModel``'s."""

    def __init__(
        self,
        model_id: str | None = None,
        device_mesh: Any = None,
        max_loras: int = 5,
        max_r: int = 32,
        max_length: int = 8192,
        target_modules: Any = None,
        **kwargs: Any,
    ):
        for key, value in (("max_loras", max_loras), ("max_r", max_r), ("max_length", max_length)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(
                    f"MultiLoraTransformersModel({key}={value!r}): {key} must be a positive integer"
                )
        super().__init__(model_id, device_mesh=device_mesh, **kwargs)
        self.max_loras, self.max_r, self.max_length = max_loras, max_r, max_length
        self.template_defaults["max_length"] = max_length
        self.adapters = SlotAdapters(self.optimizer_group, self.runtime, max_loras, max_r)
        self.model = self.adapters.attach(self.model, target_modules or DEFAULT_TARGETS)
        self.slots = self.adapters.table
        self._place_adapters()  # FSDP2 wraps once, with every slot in place


class SlotAdapters(Adapters):
    """Each adapter lent a slot of a ``SlotTable`` (``attach`` prepares the slots, all free).
    Its optimizer steps the rank-r parts of its slot (``SlotOptimizer``), and its checkpoint is a
    plain PEFT adapter of its own rank and config."""

    place_on_add = False  # the slots are attached, and the model placed, once before any adapter

    def __init__(self, groups: dict[str, Any], runtime: Any, max_loras: int, max_r: int):
        super().__init__(groups, runtime)
        self.max_loras, self.max_r = max_loras, max_r
        self.table: SlotTable | None = None
        self.configs: dict[str, Any] = {}  # adapter name -> its LoRA config
        self.active: str | None = None

    def attach(self, model: Any, target_modules: Any) -> Any:
        """``max_loras`` PEFT adapters of rank ``max_r`` on ``target_modules`` of ``model``, every
        weight trainable (which slot learns is decided by activation); returns the PEFT model."""
        from peft import LoraConfig

        slot_config = dict(
            r=self.max_r, lora_alpha=self.max_r, lora_dropout=0.0, target_modules=target_modules
        )
        for i in range(self.max_loras):
            model = add_lora(model, f"{SLOT_PREFIX}{i}", LoraConfig(**slot_config))
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.requires_grad_(True)
        self.table = SlotTable(causal_lm_of(model), self.max_loras, self.max_r)
        self.model = model
        return model

    def add(self, model: Any, name: str, config: Any) -> Any:
        """Lend a free slot to adapter ``name`` (a ``peft.LoraConfig``: its own ``r``,
        ``lora_alpha``, ``lora_dropout``, ``use_rslora``, ``target_modules``)."""
        if name in self.groups:
            raise UserError(
                f"adapter {name!r} already exists; remove_adapter({name!r}) first or pick another name"
            )
        config = self._check_config(name, config)
        self.table.acquire(name, config, self._targets_of(name, config), self.runtime.seed)
        self.configs[name] = config
        return model

    def remove(self, name: str) -> None:
        """The slot is reset (all zero) and free."""
        if self.active == name:
            self.table.activate(None)
            self.active = None
        self.table.release(name)
        del self.configs[name]

    def activate(self, name: str) -> None:
        """Its slot's layers on, its RNG stream in (the outgoing adapter's kept in its group)."""
        if self.active == name:
            return
        if self.active is not None:
            self.groups[self.active].swap_rng_out()
        seed = stream_seed(self.runtime.seed, name, "dropout", self.runtime.rank)
        self.groups[name].swap_rng_in(seed)
        self.table.activate(name)
        self.active = name

    def peft_name(self, name: str) -> str:
        return self.table.holder[name]

    def lora_config(self, name: str) -> Any:
        return self.configs[name]

    def optimizer(self, name: str, build: Build) -> SlotOptimizer:
        return SlotOptimizer(list(self.table.parameters(name)), build)

    def trainable_count(self, name: str) -> int:
        """The adapter's own rank-r weights (every slot's weights require gradients, but only the
        active one's get any)."""
        return sum(math.prod(shape) for _, shape in self.table.export_names(name))

    def describe(self) -> str:
        return f" slots={self.max_loras}x r{self.max_r}"

    def state_dict(self, name: str) -> dict[str, torch.Tensor]:
        return self.table.export(name)

    def export(self, name: str) -> tuple[dict[str, torch.Tensor], Any]:
        return self.table.export(name), self.configs[name]

    def window_params(self, name: str) -> Iterable[tuple[str, torch.nn.Parameter]]:
        return self.table.named_parameters(name, self.model)

    def restore_window_grads(self, name: str, grads: dict[str, torch.Tensor]) -> None:
        """The saved names carry the slot the adapter had then; it may hold another one now."""
        params = dict(self.model.named_parameters())
        mark = f".{self.table.holder[name]}."
        for n, g in grads.items():
            restore_grad(params[_SLOT_NAME.sub(mark, n)], g)

    def load_weights(self, folder: Path, name: str) -> None:
        integrity.verify(folder, [layout.ADAPTER_WEIGHTS])
        tensors = load_file(folder / layout.ADAPTER_WEIGHTS, device="cpu")
        expected = {k for k, _ in self.table.export_names(name)}
        unexpected = sorted(set(tensors) - expected)
        if unexpected:
            raise UserError(
                f"checkpoint {folder} holds weights this adapter does not have (e.g. {unexpected[0]})"
            )
        problems = self.table.load(name, tensors)
        if problems:
            raise UserError(
                f"checkpoint {folder} does not fit adapter {name!r}: {problems[0]}; "
                "add the adapter with the LoRA config it was saved with"
            )

    def _check_config(self, name: str, config: Any) -> Any:
        """``config`` if a slot can hold it (a copy with PEFT's default targets of this model
        type when it names none); else ``UserError``."""
        from peft import LoraConfig
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

        if not isinstance(config, LoraConfig):
            raise UserError(f"adapter {name!r}: pass a peft.LoraConfig, got {type(config).__name__}")
        if config.r > self.max_r:
            raise UserError(
                f"adapter {name!r} has r={config.r}, more than the slots' max_r={self.max_r}; "
                f"raise max_r= (MultiLoraTransformersModel(..., max_r={config.r})) or lower r"
            )
        unsupported = {
            "use_dora": bool(config.use_dora),
            "bias": config.bias != "none",
            "modules_to_save": bool(config.modules_to_save),
            "init_lora_weights": config.init_lora_weights is not True,
        }
        wrong = [k for k, bad in unsupported.items() if bad]
        if wrong:
            raise UserError(
                f"adapter {name!r}: {', '.join(wrong)} is not supported in an adapter slot; leave it at PEFT's default"
            )
        if config.target_modules is None:
            model_type = getattr(causal_lm_of(self.model).config, "model_type", None)
            if model_type not in DEFAULTS:
                raise UserError(
                    f"adapter {name!r}: set target_modules (PEFT has no default for {model_type})"
                )
            config = copy.copy(config)
            config.target_modules = set(DEFAULTS[model_type])
        return config

    def _targets_of(self, name: str, config: Any) -> list[str]:
        """The slot modules ``config`` targets; ``UserError`` for one outside the slots."""
        from peft.tuners.tuners_utils import check_target_module_exists

        lm = causal_lm_of(self.model)
        if config.target_modules == "all-linear":
            head = lm.get_output_embeddings()
            wanted = [k for k, m in lm.named_modules() if _is_linear(m) and m is not head and _plain_key(k)]
        else:
            wanted = [
                k for k, _ in lm.named_modules() if _plain_key(k) and check_target_module_exists(config, k)
            ]
        outside = [k for k in wanted if k not in self.table.layers]
        if outside or not wanted:
            slot_modules = sorted({k.rsplit(".", 1)[-1] for k in self.table.layers})
            what = f"targets {outside[0]!r}, which is" if outside else "targets no module that is"
            raise UserError(
                f"adapter {name!r} {what} outside the slots' modules ({', '.join(slot_modules)}); "
                "pick target_modules among them or widen MultiLoraTransformersModel(target_modules=...)"
            )
        return wanted


def _plain_key(key: str) -> bool:
    """A module of the base model (not a LoRA part PEFT added inside a wrapped layer)."""
    return bool(key) and not any(
        part in key.split(".") for part in ("base_layer", "lora_A", "lora_B", "lora_dropout")
    )


def _is_linear(module: Any) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, (torch.nn.Linear, LoraLayer)) and "Linear" in type(module).__name__
