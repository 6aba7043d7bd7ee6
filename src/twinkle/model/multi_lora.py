"""``MultiLoraTransformersModel``: several LoRA adapters trained on one copy of a base model.

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
from typing import Any

import torch
from safetensors.torch import load_file

from twinkle.checkpoint import integrity, layout
from twinkle.loss import build_loss
from twinkle.model.forward import causal_lm_of
from twinkle.model.lora import add_lora
from twinkle.model.slot_optimizer import SlotOptimizer
from twinkle.model.slots import SLOT_PREFIX, SlotTable
from twinkle.model.step import restore_grad
from twinkle.model.train_state import OptimizerGroup, stream_seed
from twinkle.model.transformers_model import TransformersModel
from twinkle.optim import build_optimizer
from twinkle.runtime.remote import remote_class  # remote_group= hook
from twinkle.template import Template
from twinkle.utils.errors import UserError

DEFAULT_TARGETS = "all-linear"  # the targets of a single adapter by default (``--target-modules``)
_SLOT_NAME = re.compile(rf"\.{SLOT_PREFIX}\d+\.")


@remote_class  # remote_group=: built on a device group's ranks (twinkle.runtime.remote)
class MultiLoraTransformersModel(TransformersModel):
    """``TransformersModel`` with ``max_loras`` adapter slots of rank ``max_r``.

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
        from peft import LoraConfig

        self.max_loras, self.max_r, self.max_length = max_loras, max_r, max_length
        slot_config = dict(
            r=max_r, lora_alpha=max_r, lora_dropout=0.0, target_modules=target_modules or DEFAULT_TARGETS
        )
        for i in range(max_loras):
            self.model = add_lora(self.model, f"{SLOT_PREFIX}{i}", LoraConfig(**slot_config))
        for name, param in self.model.named_parameters():
            if ".lora_" in name:  # every slot trainable: which one learns is decided by activation
                param.requires_grad_(True)
        self.slots = SlotTable(causal_lm_of(self.model), max_loras, max_r)
        for layer in self.slots.layers.values():  # free slots are all zero and off
            for slot in self.slots.names:
                for p in (layer.lora_A[slot].weight, layer.lora_B[slot].weight):
                    torch.nn.init.zeros_(p)
            layer._active_adapter = []
        self.lora_configs: dict[str, Any] = {}
        self._active: str | None = None
        self._place_adapters()  # FSDP2 wraps once, with every slot in place

    # ---------------------------------------------------------------- adapters
    def add_adapter_to_model(
        self, adapter_name: str, config: Any, gradient_accumulation_steps: int = 1
    ) -> None:
        """Lend a free slot to adapter ``adapter_name`` (a ``peft.LoraConfig``: its own ``r``,
        ``lora_alpha``, ``lora_dropout``, ``use_rslora``, ``target_modules``)."""
        if gradient_accumulation_steps < 1:
            raise UserError(
                f"--gradient-accumulation-steps must be at least 1, got {gradient_accumulation_steps}"
            )
        if not isinstance(adapter_name, str) or re.fullmatch(r"[A-Za-z0-9_-]+", adapter_name) is None:
            raise UserError(f"adapter name must be letters, digits, '_' and '-', got {adapter_name!r}")
        if adapter_name in self.optimizer_group:
            raise UserError(
                f"adapter {adapter_name!r} already exists; remove_adapter({adapter_name!r}) first or pick another name"
            )
        config = self._check_config(adapter_name, config)
        targets = self._targets_of(adapter_name, config)
        free = self.slots.free()
        if not free:
            raise UserError(
                f"all {self.max_loras} slots are taken ({', '.join(self.slots.holder)}); "
                f"remove_adapter(...) one or raise max_loras= (now {self.max_loras})"
            )
        self.slots.acquire(adapter_name, config, targets, self.runtime.seed)
        self.lora_configs[adapter_name] = config
        self.optimizer_group[adapter_name] = OptimizerGroup(
            adapter_name, gradient_accumulation_steps, loss_fn=build_loss("CrossEntropyLoss", reduction="sum")
        )

    def remove_adapter(self, adapter_name: str) -> None:
        """Drop the adapter and its training state; its slot is reset (all zero) and free."""
        group = self._group(adapter_name)
        if self._active == group.adapter_name:
            self.slots.activate(None)
            self._active = None
        if self._pending_backward is not None and self._pending_backward[0] is group:
            self._pending_backward = None
        if self._pending_eval is not None and self._pending_eval[0] == group.adapter_name:
            self._pending_eval = None
        self.slots.release(group.adapter_name)
        del self.optimizer_group[group.adapter_name], self.lora_configs[group.adapter_name]

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
        outside = [k for k in wanted if k not in self.slots.layers]
        if outside or not wanted:
            slot_modules = sorted({k.rsplit(".", 1)[-1] for k in self.slots.layers})
            what = f"targets {outside[0]!r}, which is" if outside else "targets no module that is"
            raise UserError(
                f"adapter {name!r} {what} outside the slots' modules ({', '.join(slot_modules)}); "
                "pick target_modules among them or widen MultiLoraTransformersModel(target_modules=...)"
            )
        return wanted

    def _activate(self, adapter_name: str) -> None:
        """Make ``adapter_name`` the adapter that runs: its slot's layers on, its RNG stream in."""
        if self._active == adapter_name:
            return
        if self._active is not None:
            self.optimizer_group[self._active].swap_rng_out()
        seed = stream_seed(self.runtime.seed, adapter_name, "dropout", self.runtime.rank)
        self.optimizer_group[adapter_name].swap_rng_in(seed)
        self.slots.activate(adapter_name)
        self._active = adapter_name

    # ---------------------------------------------------------------- per-adapter calls
    def set_optimizer(
        self, optimizer_cls: Any, lr: float, adapter_name: str | None = None, **kwargs: Any
    ) -> None:
        """The adapter's optimizer, over the rank-r parts of its slot (``SlotOptimizer``)."""
        group = self._group(adapter_name)
        parts = list(self.slots.parameters(group.adapter_name))
        group.optimizer = SlotOptimizer(
            parts, lambda copies: build_optimizer(optimizer_cls, copies, lr=lr, **kwargs)
        )

    def set_template(
        self, template_cls: Any = "Template", adapter_name: str | None = None, **kwargs: Any
    ) -> None:
        if not isinstance(template_cls, Template):
            kwargs.setdefault("max_length", self.max_length)
        super().set_template(template_cls, adapter_name=adapter_name, **kwargs)

    def forward(
        self,
        inputs: Any,
        task: str = "causal_lm",
        adapter_name: str | None = None,
        ref_outputs: Any = None,
        **loss_inputs: Any,
    ) -> dict[str, float]:
        group = self._group(adapter_name)
        self._activate(group.adapter_name)
        return super().forward(
            inputs, task=task, adapter_name=group.adapter_name, ref_outputs=ref_outputs, **loss_inputs
        )

    def backward(self) -> float:
        if self._pending_backward is not None:  # a recomputed forward (checkpointing) runs its adapter
            self._activate(self._pending_backward[0].adapter_name)
        return super().backward()

    def forward_only(
        self,
        inputs: Any,
        task: str = "causal_lm",
        adapter_name: str | None = None,
        disable_lora: bool = False,
        adapter_names: Any = None,
        ref_outputs: Any = None,
        **loss_inputs: Any,
    ) -> Any:
        if not disable_lora and adapter_names is None:
            adapter_name = self._group(adapter_name).adapter_name
            self._activate(adapter_name)
        return super().forward_only(
            inputs,
            task=task,
            adapter_name=adapter_name,
            disable_lora=disable_lora,
            adapter_names=adapter_names,
            ref_outputs=ref_outputs,
            **loss_inputs,
        )

    def _peft_adapter(self, adapter_name: str) -> str:
        return self.slots.holder[self._group(adapter_name).adapter_name]

    def get_train_configs(self, adapter_name: str | None = None) -> str:
        """``TransformersModel``'s line, counting as trainable the adapter's own rank-r weights
        (every slot's weights require gradients, but only the active one's get any), and the
        slots."""
        group = self._group(adapter_name)
        own = sum(math.prod(shape) for _, shape in self.slots.export_names(group.adapter_name))
        total = sum(p.numel() for p in self.model.parameters())
        line = super().get_train_configs(group.adapter_name)
        mine = f"trainable={own:,}/{total:,} ({100 * own / max(1, total):.2f}%)"
        return re.sub(r"trainable=\S+ \(\S+\)", mine, line) + f" slots={self.max_loras}x r{self.max_r}"

    # ---------------------------------------------------------------- checkpoints
    def save(
        self,
        name: str | None = None,
        output_dir: str | None = "output",
        adapter_name: str | None = None,
        **kwargs: Any,
    ):
        """``TransformersModel.save`` of one adapter: its folder is a plain PEFT adapter of its
        own rank and config, with the training state of that adapter alone."""
        group = self._group(adapter_name)
        self._activate(group.adapter_name)  # the saved RNG state is this adapter's stream
        return super().save(name, output_dir=output_dir, adapter_name=group.adapter_name, **kwargs)

    def resume_from_checkpoint(
        self, checkpoint_dir: str, resume_only_model: bool = False, adapter_name: str | None = None
    ) -> dict[str, int]:
        """Resume one adapter; the others keep their weights, state and open windows."""
        group = self._group(adapter_name)
        self._activate(group.adapter_name)  # the restored RNG state becomes this adapter's stream
        return super().resume_from_checkpoint(
            checkpoint_dir, resume_only_model, adapter_name=group.adapter_name
        )

    def _lora_config(self, group: OptimizerGroup) -> Any:
        return self.lora_configs[group.adapter_name]

    def _adapter_export(self, group: OptimizerGroup) -> tuple[dict[str, torch.Tensor], Any]:
        return self.slots.export(group.adapter_name), self.lora_configs[group.adapter_name]

    def _window_params(self, group: OptimizerGroup) -> Any:
        return self.slots.named_parameters(group.adapter_name, self.model)

    def _restore_window_grads(self, group: OptimizerGroup, grads: dict[str, torch.Tensor]) -> None:
        """The saved names carry the slot the adapter had then; it may hold another one now."""
        params = dict(self.model.named_parameters())
        mark = f".{self.slots.holder[group.adapter_name]}."
        for n, g in grads.items():
            restore_grad(params[_SLOT_NAME.sub(mark, n)], g)

    def _load_weights(self, folder: Any, group: OptimizerGroup) -> None:
        integrity.verify(folder, [layout.ADAPTER_WEIGHTS])
        tensors = load_file(folder / layout.ADAPTER_WEIGHTS, device="cpu")
        expected = {k for k, _ in self.slots.export_names(group.adapter_name)}
        unexpected = sorted(set(tensors) - expected)
        if unexpected:
            raise UserError(
                f"checkpoint {folder} holds weights this adapter does not have (e.g. {unexpected[0]})"
            )
        problems = self.slots.load(group.adapter_name, tensors)
        if problems:
            raise UserError(
                f"checkpoint {folder} does not fit adapter {group.adapter_name!r}: {problems[0]}; "
                "add the adapter with the LoRA config it was saved with"
            )


def _plain_key(key: str) -> bool:
    """A module of the base model (not a LoRA part PEFT added inside a wrapped layer)."""
    return bool(key) and not any(
        part in key.split(".") for part in ("base_layer", "lora_A", "lora_B", "lora_dropout")
    )


def _is_linear(module: Any) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, (torch.nn.Linear, LoraLayer)) and "Linear" in type(module).__name__
