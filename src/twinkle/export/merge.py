"""Fold a LoRA adapter into its base model and save the result as a Hugging Face folder.

The merge runs in float32 whatever the output dtype: ``W + B @ A * scale`` computed in bfloat16
would round the (small) adapter update away against the (large) base weight. The merged model
is cast to the output dtype afterwards, once."""

from pathlib import Path
from typing import Any

import torch

from twinkle.export.source import ExportSource
from twinkle.hub import pretrained_options
from twinkle.utils.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def base_dtype(base_dir: Path) -> str:
    """The dtype the base model's config names, when it is one of ``DTYPES``; else float32."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(base_dir))
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    name = str(dtype).removeprefix("torch.") if dtype is not None else "float32"
    return name if name in DTYPES else "float32"


def load_tokenizer(source: ExportSource) -> Any:
    """The tokenizer saved with the checkpoint (the one training used, chat template included),
    else the base model's."""
    from transformers import AutoTokenizer

    folder = (
        source.adapter_dir if (source.adapter_dir / "tokenizer_config.json").is_file() else source.base_dir
    )
    return AutoTokenizer.from_pretrained(str(folder))


def merge_adapter(source: ExportSource, dtype: str) -> Any:
    """The base model with the adapter folded in (``merge_and_unload``), cast to ``dtype``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(
        str(source.base_dir), dtype=torch.float32, **pretrained_options()
    )
    try:
        peft_model = PeftModel.from_pretrained(base, str(source.adapter_dir))
    except (ValueError, KeyError, RuntimeError) as exc:
        raise UserError(
            f"the adapter in {source.adapter_dir} does not fit the base model {source.base_id} "
            f"({type(exc).__name__}: {str(exc).splitlines()[0]}); pass the right base with --model-id"
        ) from exc
    try:
        merged = peft_model.merge_and_unload(safe_merge=True)
    except ValueError as exc:  # safe_merge found NaN in a merged weight
        raise UserError(
            f"merging the adapter in {source.adapter_dir} gives NaN weights; the run that saved it diverged"
        ) from exc
    return merged.to(DTYPES[dtype]).eval()


def save_merged(model: Any, tokenizer: Any, folder: Path, max_shard_size: str) -> None:
    """Safetensors shards (an index file when there are several), ``config.json``,
    ``generation_config.json``, the tokenizer files and the chat template."""
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(folder)
