"""Attach a PEFT LoRA adapter."""

import copy
import warnings
from typing import Any

from twinkle.model.expert_lora import check_target_parameters
from twinkle.utils.errors import UserError

DEPRECATED_ALIAS = "`is_gradient_checkpointing` is deprecated"


def all_linear_alone(config: Any) -> Any:
    """``config`` with ``target_modules=['all-linear']`` (upstream's scripts write the shortcut in a
    list, which PEFT would look for as a module name) as the shortcut itself; others unchanged."""
    targets = getattr(config, "target_modules", None)
    if isinstance(targets, (list, tuple, set, frozenset)) and "all-linear" in targets:
        if len(targets) > 1:
            raise UserError(
                f"target_modules={sorted(targets)}: 'all-linear' already names every linear layer; "
                "give it alone or list the module names"
            )
        config = copy.copy(config)
        config.target_modules = "all-linear"
    return config


def add_lora(model: Any, adapter_name: str, config: Any) -> Any:
    """Wrap ``model`` with PEFT (or add a further adapter to a PEFT model) and make it active.
    Its LoRA linear layers run as one autograd node each (``twinkle.kernel.lora.linear``)."""
    from peft import PeftModel, get_peft_model

    from twinkle.kernel.lora.linear import fuse_lora_linears

    if isinstance(model, PeftModel):
        if adapter_name in model.peft_config:
            raise UserError(f"adapter {adapter_name!r} already exists; pick another --adapter-name")
        model.add_adapter(adapter_name, config)
        model.set_adapter(adapter_name)
    else:
        check_target_parameters(model, config)  # LoRA on experts of a model without them: one line
        try:
            with warnings.catch_warnings():
                # PEFT 0.21 reads transformers' deprecated alias while wrapping any model: a
                # FutureWarning in every run that the user can do nothing about
                warnings.filterwarnings("ignore", DEPRECATED_ALIAS, FutureWarning)
                model = get_peft_model(model, config, adapter_name=adapter_name)
        except ValueError as exc:
            raise UserError(f"cannot add LoRA adapter {adapter_name!r}: {exc}") from exc
    fuse_lora_linears(model)
    return model


def trainable_parameters(model: Any) -> list[Any]:
    return [p for p in model.parameters() if p.requires_grad]


def lora_signature(config: Any) -> dict[str, Any]:
    """The parts of a LoRA config that must match for a checkpoint to load; ``{}`` without LoRA
    (a full-parameter model, ``twinkle.model.full_parameter``)."""
    if config is None:
        return {}
    targets = config.target_modules
    if isinstance(targets, (set, list, tuple)):
        targets = sorted(targets)
    signature = {"r": config.r, "lora_alpha": config.lora_alpha, "target_modules": targets}
    if getattr(config, "target_parameters", None):  # LoRA on experts (twinkle.model.expert_lora)
        signature["target_parameters"] = sorted(config.target_parameters)
    return signature
