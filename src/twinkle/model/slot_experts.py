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
of the experts its rank holds, as a single adapter's does (``twinkle.model.expert_parallel``)."""

import warnings
from typing import Any

import torch

from twinkle.model.lora import DEPRECATED_ALIAS
from twinkle.utils.errors import UserError


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
