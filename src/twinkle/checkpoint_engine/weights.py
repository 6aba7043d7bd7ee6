"""What a weight sync sends besides the adapter's own LoRA matrices, computed on the trainer:
``base_weight`` (a linear layer's full base weight) and ``merged_weights`` (``W + scaling * B @ A``
for each layer the adapter covers). The local manager and the device-group sync both use them."""

from typing import Any

import torch

from twinkle.model import TransformersModel
from twinkle.model.forward import causal_lm_of
from twinkle.model.slots import full, lora_scaling
from twinkle.sampler import adapters


def base_weight(model: TransformersModel, key: str) -> torch.Tensor:
    """The trainer's full base weight of linear layer ``key`` (relative to the causal LM)."""
    module = causal_lm_of(model.model).get_submodule(key)
    layer = module.base_layer if hasattr(module, "base_layer") else module
    return full(layer.weight)


@torch.no_grad()
def merged_weights(
    model: TransformersModel, tensors: dict[str, torch.Tensor], config: Any
) -> dict[str, torch.Tensor]:
    """``W + scaling * B @ A`` for each linear layer the adapter's ``tensors`` cover, in fp32 and
    cast back to the weight's dtype."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for saved, value in tensors.items():
        key, kind = adapters.split_name(saved)
        pairs.setdefault(key, {})[kind] = value
    scaling = lora_scaling(config)
    out = {}
    for key, pair in pairs.items():
        weight = base_weight(model, key)
        a = pair["lora_A"].to(weight.device, torch.float32)
        b = pair["lora_B"].to(weight.device, torch.float32)
        out[key] = (weight.float() + scaling * (b @ a)).to(weight.dtype)
    return out
