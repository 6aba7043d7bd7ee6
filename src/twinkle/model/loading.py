"""Load a causal LM and its tokenizer from any id the hub resolves."""

from pathlib import Path
from typing import Any

import torch

from twinkle.utils.errors import UserError


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on accelerators; fp32 on CPU, where bf16 matmuls are ~25x slower."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def load_causal_lm(
    model_id: str | None, device: torch.device, dtype: torch.dtype | None = None
) -> tuple[Any, Any, Path]:
    from transformers import AutoModelForCausalLM

    from twinkle.hub import resolve_model
    from twinkle.template.tokenizer import load_tokenizer

    path = resolve_model(model_id)
    dtype = dtype or default_dtype(device)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot load a causal language model from {path} ({exc})") from exc
    tokenizer = load_tokenizer(model_id)  # the one the dataset's template already loaded, if any
    return model.to(device), tokenizer, path
