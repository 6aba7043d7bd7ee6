"""``MultiLoraTransformersModel``: several LoRA adapters trained on one copy of a base model, and
``SlotAdapters``, the ``twinkle.model.adapters.Adapters`` that holds them.

The base is loaded once and ``max_loras`` adapter slots (``twinkle.model.slots``) are attached
before any FSDP2 wrapping, so adapters can come and go under FSDP2: ``add_adapter_to_model``
lends a free slot to an adapter of rank ``r <= max_r``, ``remove_adapter`` gives it back. Each
adapter has its own ``OptimizerGroup`` (optimizer over its rank-r weights, schedule, loss,
template, metrics, checkpoints), named by ``adapter_name=`` in every per-adapter call.

The slots go where ``lora_config=`` (upstream's keyword) or ``target_modules=`` says
(``twinkle.model.slot_config``); on a mixture-of-experts model they may reach the fused experts
(``target_parameters``, ``twinkle.model.slot_experts``), also when the first adapter that names
them is added before the model is placed, and under expert parallelism as a single adapter does.

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
from twinkle.model.optim_setup import set_window
from twinkle.model.slot_config import adapter_layout, converted, expert_targets, slot_config
from twinkle.model.slot_experts import attach as attach_expert_slots
from twinkle.model.slot_experts import has_fused_experts
from twinkle.model.slot_optimizer import SlotOptimizer
from twinkle.model.slots import SLOT_PREFIX, SlotTable, is_param_wrapper
from twinkle.model.step import restore_grad
from twinkle.model.train_state import stream_seed
from twinkle.model.transformers_model import TransformersModel
from twinkle.runtime.remote import remote_class  # remote_group= hook
from twinkle.utils.errors import UserError

_SLOT_NAME = re.compile(rf"\.{SLOT_PREFIX}\d+\.")


@remote_class  # remote_group=: built on a device group's ranks (twinkle.runtime.remote)
class MultiLoraTransformersModel(TransformersModel):
    """``TransformersModel`` with ``max_loras`` adapter slots of rank ``max_r`` (``SlotAdapters``).

    ``target_modules``: the slots' modules (default ``all-linear``); ``lora_config``: upstream's
    slot config, a ``peft.LoraConfig`` (or dict) whose ``target_modules``, ``exclude_modules`` and
    ``target_parameters`` place the slots (``twinkle.model.slot_config``). Each adapter's targets
    must be among the slots'. ``max_length``: the default ``max_length`` of the templates
    ``set_template`` builds. Other keywords are ``TransformersModel``'s.

    A model with fused experts is placed (sharded, its experts split) at its first per-adapter
    call or ``_lazy_wrap_model()``, so that adapters added before may bring LoRA on the experts
    (``twinkle.model.slot_experts``); any other model when it is built."""

    def __init__(
        self,
        model_id: str | None = None,
        device_mesh: Any = None,
        max_loras: int = 5,
        max_r: int = 32,
        max_length: int = 8192,
        target_modules: Any = None,
        lora_config: Any = None,
        **kwargs: Any,
    ):
        for key, value in (("max_loras", max_loras), ("max_r", max_r), ("max_length", max_length)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(
                    f"MultiLoraTransformersModel({key}={value!r}): {key} must be a positive integer"
                )
        slots = slot_config(lora_config, target_modules, max_r)  # its refusals before loading
        super().__init__(model_id, device_mesh=device_mesh, **kwargs)
        self.max_loras, self.max_r, self.max_length = max_loras, max_r, max_length
        self.template_defaults["max_length"] = max_length
        self.adapters = SlotAdapters(self.optimizer_group, self.runtime, max_loras, max_r)
        self.model = self.adapters.attach(self.model, slots)
        self.slots = self.adapters.table
        if not has_fused_experts(causal_lm_of(self.model)):
            self._lazy_wrap_model()

    def _lazy_wrap_model(self) -> None:
        """Place the model once (FSDP2 wraps it, expert parallelism keeps this rank's experts),
        with every slot in place; later calls do nothing."""
        if not self.adapters.placed:
            self.adapters.placed = True
            self._place_adapters()

    def _group(self, adapter_name: str | None) -> Any:
        self._lazy_wrap_model()  # every per-adapter call runs on the placed model
        return super()._group(adapter_name)

    def forward_backward(
        self, inputs: Any, *args: Any, gradient_accumulation_steps: int | None = None, **kwargs: Any
    ) -> Any:
        """``TransformersModel.forward_backward``; ``gradient_accumulation_steps`` (upstream's
        per-call keyword, as ``clip_grad_and_step`` takes it) sets the adapter's window length."""
        if gradient_accumulation_steps is not None:
            set_window(self._group(kwargs.get("adapter_name")), gradient_accumulation_steps)
        return super().forward_backward(inputs, *args, **kwargs)


class SlotAdapters(Adapters):
    """Each adapter lent a slot of a ``SlotTable`` (``attach`` prepares the slots, all free).
    Its optimizer steps the rank-r parts of its slot (``SlotOptimizer``), and its checkpoint is a
    plain PEFT adapter of its own rank and config."""

    place_on_add = False  # the slots are attached, and the model placed, once before any adapter

    def __init__(self, groups: dict[str, Any], runtime: Any, max_loras: int, max_r: int):
        super().__init__(groups, runtime)
        self.max_loras, self.max_r = max_loras, max_r
        self.table: SlotTable | None = None
        self.configs: dict[str, Any] = {}  # adapter name -> its LoRA config (as PEFT converts it)
        self.active: str | None = None
        self.placed = False  # the model is sharded / its experts split (no new slot layers)

    def attach(self, model: Any, config: Any) -> Any:
        """``max_loras`` PEFT adapters of ``config`` (the slots', ``slot_config``) on ``model``,
        every weight trainable (which slot learns is decided by activation); returns the PEFT
        model."""
        for i in range(self.max_loras):
            model = add_lora(model, f"{SLOT_PREFIX}{i}", copy.deepcopy(config))
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.requires_grad_(True)
        self.table = SlotTable(causal_lm_of(model), self.max_loras, self.max_r)
        self.model = model
        return model

    def add(self, model: Any, name: str, config: Any) -> Any:
        """Lend a free slot to adapter ``name`` (a ``peft.LoraConfig``: its own ``r``,
        ``lora_alpha``, ``lora_dropout``, ``use_rslora``, ``rank_pattern``, ``alpha_pattern``,
        ``target_modules``, ``exclude_modules``, ``target_parameters``). Expert parameters it
        names that no slot holds yet get slots first (``twinkle.model.slot_experts``)."""
        if name in self.groups:
            raise UserError(
                f"adapter {name!r} already exists; remove_adapter({name!r}) first or pick another name"
            )
        lm = causal_lm_of(self.model)
        config = converted(self._check_config(name, config), lm)
        self._check_parameters(name, config, lm)
        held = [k for k, m in self.table.layers.items() if is_param_wrapper(m)]
        new = [t for t in expert_targets(config) if not any(k == t or k.endswith("." + t) for k in held)]
        if new:
            attach_expert_slots(lm, self.table.names, new, self.max_r, self.placed)
            self.table.refresh(lm)
        modules = self._targets_of(name, config)
        if config.target_modules == "all-linear":  # saved as PEFT saves it: the linear layers' names
            config.target_modules = {k.rsplit(".", 1)[-1] for k in self._linear_keys(lm)}
        layout = adapter_layout(name, config, self.table.layers, modules, self.table.names[0])
        self.table.acquire(name, config, layout, self.runtime.seed)
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
        if config.target_modules is None and not config.target_parameters:
            model_type = getattr(causal_lm_of(self.model).config, "model_type", None)
            if model_type not in DEFAULTS:
                raise UserError(
                    f"adapter {name!r}: set target_modules (PEFT has no default for {model_type})"
                )
            config = copy.copy(config)
            config.target_modules = set(DEFAULTS[model_type])
        return config

    @staticmethod
    def _linear_keys(lm: Any) -> list[str]:
        """The keys of ``lm``'s linear layers but its output head (what ``all-linear`` names)."""
        head = lm.get_output_embeddings()
        return [k for k, m in lm.named_modules() if _is_linear(m) and m is not head and _plain_key(k)]

    @staticmethod
    def _check_parameters(name: str, config: Any, lm: Any) -> None:
        """One line for ``target_parameters`` the model does not hold (a dense model's experts)."""
        plain = [n.replace(".base_layer", "") for n, _ in lm.named_parameters()]
        absent = [t for t in expert_targets(config) if not any(n == t or n.endswith("." + t) for n in plain)]
        if absent:
            raise UserError(
                f"adapter {name!r}: target_parameters {absent}: the model ({lm.config.model_type}) has no such "
                "parameter; LoRA on experts needs a mixture-of-experts model with fused expert weights"
            )

    def _targets_of(self, name: str, config: Any) -> list[str]:
        """The slot modules ``config`` targets (none where it names only ``target_parameters``);
        ``UserError`` for one outside the slots."""
        from peft.tuners.tuners_utils import check_target_module_exists

        lm = causal_lm_of(self.model)
        if config.target_modules == "all-linear":
            wanted = [k for k in self._linear_keys(lm) if not _excluded(config, k)]
        elif not config.target_modules:
            wanted = []
        else:
            wanted = [
                k for k, _ in lm.named_modules() if _plain_key(k) and check_target_module_exists(config, k)
            ]
        outside = [k for k in wanted if k not in self.table.layers]
        if outside or not (wanted or config.target_parameters):
            slot_modules = sorted({k.rsplit(".", 1)[-1] for k in self.table.layers})
            what = f"targets {outside[0]!r}, which is" if outside else "targets no module that is"
            raise UserError(
                f"adapter {name!r} {what} outside the slots' modules ({', '.join(slot_modules)}); "
                "pick target_modules among them or widen MultiLoraTransformersModel(target_modules=...)"
            )
        return wanted


def _excluded(config: Any, key: str) -> bool:
    """``key`` is among ``config.exclude_modules`` (PEFT's match: a regex on the whole key, or a
    name equal to the key or its dotted end)."""
    exclude = config.exclude_modules
    if not exclude:
        return False
    if isinstance(exclude, str):
        return re.fullmatch(exclude, key) is not None
    return any(key == e or key.endswith("." + e) for e in exclude)


def _plain_key(key: str) -> bool:
    """A module of the base model (not a LoRA part PEFT added inside a wrapped layer)."""
    return bool(key) and not any(
        part in key.split(".") for part in ("base_layer", "lora_A", "lora_B", "lora_dropout")
    )


def _is_linear(module: Any) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, (torch.nn.Linear, LoraLayer)) and "Linear" in type(module).__name__
