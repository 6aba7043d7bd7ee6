"""How a ``TransformersModel`` holds its LoRA adapters: the ``Adapters`` interface, its plain
PEFT implementation ``PeftAdapters``, and ``set_active``, the one writer of PEFT's per-layer
active adapter.

The model owns one ``Adapters`` object (``model.adapters``) and asks it for everything that
depends on where an adapter's weights live: attaching an adapter, making it the one that runs,
the parameters its optimizer steps, its LoRA config, its weights as saved and loaded, and the
parameters whose gradients an open accumulation window holds. The training step, the metrics and
the checkpoint code are the same for every implementation. ``PeftAdapters`` keeps each adapter
as a PEFT adapter of its own name (``TransformersModel``); ``twinkle.model.slots.SlotAdapters``
lends each one a slot of ``max_loras`` adapters prepared once (``MultiLoraTransformersModel``)."""

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from twinkle.checkpoint.load import load_adapter_weights
from twinkle.checkpoint.save import full_adapter_state
from twinkle.model.lora import add_lora, trainable_parameters
from twinkle.model.step import restore_grad
from twinkle.optim.replicated import ReplicatedOptimizer
from twinkle.utils.errors import UserError

Build = Callable[[list[torch.nn.Parameter]], Any]  # the user's optimizer over the given parameters


def set_active(layer: Any, names: list[str]) -> None:
    """PEFT LoRA ``layer`` runs the adapters ``names`` (``[]``: none). Written directly: PEFT's
    ``set_adapter`` would also switch the adapters' ``requires_grad``, which the optimizers (and
    FSDP2, when it wrapped them) fixed."""
    layer._active_adapter = names


class Adapters:
    """The adapters of one model, by the user's adapter names. ``groups`` is the model's
    ``optimizer_group`` (one ``OptimizerGroup`` per adapter, kept by the model), ``runtime`` the
    run's ``Runtime``; ``model`` is the PEFT model, once an adapter is attached."""

    place_on_add = True  # an add attaches new layers, which the model's placement (FSDP2) must see

    def __init__(self, groups: dict[str, Any], runtime: Any):
        self.groups = groups
        self.runtime = runtime
        self.model: Any = None

    def add(self, model: Any, name: str, config: Any) -> Any:
        """Attach adapter ``name`` (a ``peft.LoraConfig``) to ``model``; returns the model that
        holds it (PEFT's wrapper). The caller has checked the name."""
        raise NotImplementedError

    def remove(self, name: str) -> None:
        """Drop adapter ``name``'s weights (its training state is the model's to drop)."""
        raise NotImplementedError

    def activate(self, name: str) -> None:
        """Adapter ``name`` is the one that runs from here on (training, evaluation, saving)."""
        raise NotImplementedError

    def peft_name(self, name: str) -> str:
        """The PEFT adapter that holds ``name``'s weights."""
        raise NotImplementedError

    def lora_config(self, name: str) -> Any:
        """The ``peft.LoraConfig`` adapter ``name`` was added with."""
        raise NotImplementedError

    def optimizer(self, name: str, build: Build) -> ReplicatedOptimizer:
        """The optimizer of adapter ``name``: ``build`` over its trainable weights."""
        raise NotImplementedError

    def trainable_count(self, name: str) -> int:
        """How many weights adapter ``name`` trains."""
        raise NotImplementedError

    def describe(self) -> str:
        """What ``get_train_configs`` adds to its line (empty, or `` key=value``)."""
        return ""

    def state_dict(self, name: str) -> dict[str, torch.Tensor]:
        """Adapter ``name``'s weights, full size on the CPU, under the names of its
        ``adapter_model.safetensors`` (a collective under FSDP)."""
        raise NotImplementedError

    def export(self, name: str) -> tuple[dict[str, torch.Tensor], Any] | None:
        """What a checkpoint of adapter ``name`` writes: ``(state_dict, lora_config)``, or None
        for ``twinkle.checkpoint.save_checkpoint`` to gather PEFT's state of ``peft_name`` itself."""
        raise NotImplementedError

    def window_params(self, name: str) -> Iterable[tuple[str, torch.nn.Parameter]]:
        """(model parameter name, parameter) of every weight whose gradient belongs to adapter
        ``name``'s open accumulation window."""
        raise NotImplementedError

    def restore_window_grads(self, name: str, grads: dict[str, torch.Tensor]) -> None:
        """Put back the gradients ``window_params`` gave at a save (names and shapes checked when
        the file was read)."""
        raise NotImplementedError

    def load_weights(self, folder: Path, name: str) -> None:
        """Adapter ``name``'s weights from a checkpoint ``folder`` (verified against its marker)."""
        raise NotImplementedError


class PeftAdapters(Adapters):
    """Each adapter a PEFT adapter of its own name. ``activate`` makes the named one the one PEFT
    runs and trains (PEFT's ``set_adapter`` also leaves only its weights requiring gradients), so
    each operation, optimizer and count reads its own adapter: PEFT otherwise runs the last one
    added, whatever ``adapter_name`` a call gives."""

    def add(self, model: Any, name: str, config: Any) -> Any:
        if self.runtime.is_distributed and self.groups:
            raise UserError(
                "under FSDP a model takes one LoRA adapter (its weights are sharded with the model); "
                f"it already has {', '.join(self.groups)}"
            )
        self.model = add_lora(model, name, config)
        return self.model

    def remove(self, name: str) -> None:
        raise UserError(
            f"remove_adapter({name!r}): the adapters of a TransformersModel stay for its lifetime; "
            "build a MultiLoraTransformersModel(...) for adapters that come and go"
        )

    def activate(self, name: str) -> None:
        if list(getattr(self.model, "active_adapters", ())) != [name]:
            self.model.set_adapter(name)

    def peft_name(self, name: str) -> str:
        return name

    def lora_config(self, name: str) -> Any:
        return self.model.peft_config[name]

    def optimizer(self, name: str, build: Build) -> ReplicatedOptimizer:
        self.activate(name)  # its weights alone require gradients
        return ReplicatedOptimizer(trainable_parameters(self.model), build)

    def trainable_count(self, name: str) -> int:
        self.activate(name)
        return sum(p.numel() for p in trainable_parameters(self.model))

    def state_dict(self, name: str) -> dict[str, torch.Tensor]:
        return full_adapter_state(self.model, name)

    def export(self, name: str) -> None:
        return None  # gathered inside the save's write phase, whose failures every rank agrees on

    def window_params(self, name: str) -> Iterable[tuple[str, torch.nn.Parameter]]:
        return self.model.named_parameters()

    def restore_window_grads(self, name: str, grads: dict[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters())
        for n, g in grads.items():
            restore_grad(params[n], g)

    def load_weights(self, folder: Path, name: str) -> None:
        load_adapter_weights(self.model, folder, name)
