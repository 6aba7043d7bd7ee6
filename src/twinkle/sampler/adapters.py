"""LoRA adapters inside a sampler's model: which one runs, and adapters written into a model the
sampler owns (from a PEFT folder or from a trainer's weights).

The adapter that runs is chosen by setting each PEFT LoRA layer's active adapter directly and
putting the old value back afterwards, as ``twinkle.model.lora_modes`` does: PEFT's own
``set_adapter`` would also switch ``requires_grad``, which the trainer's optimizer (and FSDP2)
fixed when they were built.

Weights travel under the names of a PEFT ``adapter_model.safetensors`` (``base_model.model.<module
key>.lora_A.weight``, without the adapter name), what ``TransformersModel.get_state_dict`` returns."""

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from twinkle.model.adapters import set_active
from twinkle.utils.errors import UserError

PREFIX = "base_model.model."
KINDS = ("lora_A", "lora_B")


@contextlib.contextmanager
def running_adapter(layers: list[Any], name: str | None) -> Iterator[None]:
    """PEFT adapter ``name`` runs on every layer that has it, nothing elsewhere (None: the base
    model alone)."""
    saved = [(layer.active_adapters, layer._disable_adapters) for layer in layers]
    for layer in layers:
        set_active(layer, [name] if name is not None and name in layer.lora_A else [])
        layer._disable_adapters = False
    try:
        yield
    finally:
        for layer, (active, disabled) in zip(layers, saved, strict=True):
            set_active(layer, active)
            layer._disable_adapters = disabled


def split_name(saved: str) -> tuple[str, str]:
    """``base_model.model.<key>.lora_A.weight`` -> (``<key>``, ``lora_A``)."""
    body = saved[len(PREFIX) :] if saved.startswith(PREFIX) else saved
    for kind in KINDS:
        tail = f".{kind}.weight"
        if body.endswith(tail):
            return body[: -len(tail)], kind
    raise UserError(
        f"adapter weight {saved!r} is not a LoRA A/B matrix of a linear layer; only plain LoRA on "
        "linear layers can be sampled (no embedding LoRA, DoRA or modules_to_save)"
    )


def text_key(key: str) -> str:
    """``key`` as a text-only model names it: a multimodal model keeps its language model under
    ``model.language_model.``, the causal LM of the same family (what ``AutoModelForCausalLM``
    loads from that checkpoint, as a sampler does) under ``model.``, so a multimodal trainer's
    adapter reaches a text sampler's layers."""
    head = "model.language_model."
    return "model." + key[len(head) :] if key.startswith(head) else key


def read_folder(path: str | Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """A PEFT adapter folder -> (its ``LoraConfig``, its weights under their saved names)."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    folder = Path(path)
    config_file, weights = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    missing = [p.name for p in (config_file, weights) if not p.is_file()]
    if missing:
        raise UserError(
            f"adapter_path={str(path)!r} is not a PEFT adapter folder (no {', '.join(missing)}); "
            "pass a folder saved by model.save(...) or PeftModel.save_pretrained"
        )
    try:
        config = LoraConfig.from_pretrained(str(folder))
        tensors = load_file(str(weights), device="cpu")
    except (OSError, ValueError, TypeError, json.JSONDecodeError) as exc:
        raise UserError(f"adapter_path={str(path)!r}: cannot read the adapter ({exc})") from exc
    return config, tensors


def check_plain_lora(config: Any, where: str) -> None:
    if getattr(config, "use_dora", False) or getattr(config, "modules_to_save", None):
        raise UserError(f"{where}: DoRA and modules_to_save adapters cannot be sampled; use plain LoRA")


def install(lm: Any, name: str, config: Any) -> None:
    """Add PEFT adapter ``name`` (``config``) to ``lm`` in place, frozen, with the one-node LoRA
    forward (``twinkle.kernel.lora.linear``)."""
    from peft import inject_adapter_in_model

    from twinkle.kernel.lora.linear import fuse_lora_linears

    check_plain_lora(config, f"adapter {name!r}")
    try:
        inject_adapter_in_model(config, lm, adapter_name=name)
    except ValueError as exc:
        raise UserError(f"cannot add adapter {name!r} to the sampler's model: {exc}") from exc
    for param_name, param in lm.named_parameters():
        if ".lora_" in param_name:
            param.requires_grad_(False)
    fuse_lora_linears(lm)


@torch.no_grad()
def write(lm: Any, name: str, tensors: dict[str, torch.Tensor]) -> int:
    """Copy ``tensors`` (saved names) into adapter ``name`` of ``lm`` in place; returns the bytes
    written. Every LoRA matrix of the adapter must be given, each of its shape."""
    targets = {}
    for layer_key, layer in _named_lora_layers(lm):
        if name in layer.lora_A:
            for kind in KINDS:
                targets[(text_key(layer_key), kind)] = getattr(layer, kind)[name].weight
    given = {}
    for saved, value in tensors.items():
        key, kind = split_name(saved)
        given[(text_key(key), kind)] = value
    missing = sorted(set(targets) - set(given))
    extra = sorted(set(given) - set(targets))
    if missing or extra:
        key, kind = (missing or extra)[0]
        what = "has no weight for" if missing else "has a weight the sampler's adapter lacks:"
        raise UserError(
            f"adapter {name!r}: the source {what} {key}.{kind}; the sampler's adapter and the "
            "source must have the same target modules"
        )
    written = 0
    for where, param in targets.items():
        value = given[where]
        if tuple(value.shape) != tuple(param.shape):
            raise UserError(
                f"adapter {name!r}: {where[0]}.{where[1]} has shape {tuple(value.shape)}, the sampler's "
                f"{tuple(param.shape)}; the LoRA rank must match"
            )
        param.copy_(value)
        written += param.numel() * param.element_size()
    return written


def _named_lora_layers(lm: Any) -> Iterator[tuple[str, Any]]:
    from peft.tuners.lora import LoraLayer

    return ((k, m) for k, m in lm.named_modules() if isinstance(m, LoraLayer))
