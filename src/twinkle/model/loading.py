"""Load a causal LM and its tokenizer from any id the hub resolves."""

import json
from pathlib import Path
from typing import Any

import torch

from twinkle.utils.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on accelerators; fp32 on CPU. A CPU without native bf16 instructions runs bf16
    matmuls many times slower than fp32; one with them runs them faster, but the loss then differs
    from fp32 by bf16 rounding, so bf16 there is a choice (``--dtype bfloat16``), not a default."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``--dtype``: ``auto`` (``default_dtype``), ``float32`` or ``bfloat16``."""
    if name == "auto":
        return default_dtype(device)
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r}; use auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def _check_model_type(model_cls: Any, path: Path) -> None:
    """One line when ``model_cls`` is written for another architecture than the checkpoint's:
    transformers would only warn, then build the class's default-sized model with random weights.
    A ``*_text`` class loading its multimodal family's checkpoint (or the reverse) is the same
    architecture."""
    wanted = getattr(getattr(model_cls, "config_class", None), "model_type", None)  # None: an Auto class
    config_file = Path(path) / "config.json"
    if not wanted or not config_file.is_file():
        return
    try:
        found = json.loads(config_file.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return
    if found and wanted.removesuffix("_text") != found.removesuffix("_text"):
        raise UserError(
            f"model_cls={model_cls.__name__} builds {wanted!r} models, but {path} holds a {found!r} "
            "checkpoint; pass a class for that checkpoint (e.g. AutoModelForCausalLM) or a matching model_id"
        )


def load_causal_lm(
    model_id: str | None,
    device: torch.device,
    dtype: torch.dtype | None = None,
    model_cls: Any = None,
    config: Any = None,
    attn: str | None = None,
    ignore_mismatched_sizes: bool = False,
) -> tuple[Any, Any, Path]:
    """``model_cls.from_pretrained`` (default ``AutoModelForCausalLM``) on the folder the hub
    resolves ``model_id`` to, optionally with ``config``; the tokenizer from the same folder;
    transformers' own hub kernels off (``twinkle.hub.pretrained_options``)."""
    from transformers import AutoModelForCausalLM

    from twinkle.hub import pretrained_options, resolve_model
    from twinkle.template.tokenizer import load_tokenizer

    path = resolve_model(model_id)
    dtype = dtype or default_dtype(device)
    model_cls = model_cls or AutoModelForCausalLM
    if isinstance(model_cls, str):  # --model-cls: a transformers class name
        import transformers

        name, model_cls = model_cls, getattr(transformers, model_cls, None)
        if model_cls is None:
            raise UserError(f"--model-cls {name}: transformers has no such class; e.g. AutoModelForCausalLM")
    if not hasattr(model_cls, "from_pretrained"):
        raise UserError(f"model_cls={model_cls!r} has no from_pretrained(); pass a transformers model class")
    if config is None:
        _check_model_type(model_cls, path)
    extra = pretrained_options()
    if config is not None:
        extra["config"] = config
    if attn is not None:  # attn_implementation= (twinkle.model.attention_choice)
        extra["attn_implementation"] = attn
    if ignore_mismatched_sizes:  # upstream's TransformersModel keyword, from_pretrained's meaning
        extra["ignore_mismatched_sizes"] = True
    try:
        model = model_cls.from_pretrained(str(path), dtype=dtype, **extra)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot load a causal language model from {path} ({exc})") from exc
    tokenizer = load_tokenizer(model_id)  # the one the dataset's template already loaded, if any
    return model.to(device), tokenizer, path
