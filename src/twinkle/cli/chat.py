"""Greedy chat with a base model plus a saved LoRA checkpoint."""

from collections.abc import Iterator
from pathlib import Path

import torch

from twinkle.preprocessor.self_cognition import SYSTEM_PROMPT
from twinkle.utils.errors import UserError


def load_for_chat(model_id: str | None, adapter: str | None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from twinkle.hub import resolve_model

    path = resolve_model(model_id)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if adapter:
        from peft import PeftModel

        folder = Path(adapter).expanduser()
        if not (folder / "adapter_config.json").is_file():
            raise UserError(
                f"{folder} holds no adapter (adapter_config.json); pass a checkpoint folder to --adapter"
            )
        model = PeftModel.from_pretrained(model, str(folder))
    return model.eval(), tokenizer


@torch.no_grad()
def chat(
    model_id: str | None,
    adapter: str | None,
    prompts: list[str],
    system: str | None = None,
    max_new_tokens: int = 64,
) -> Iterator[tuple[str, str]]:
    model, tokenizer = load_for_chat(model_id, adapter)
    for prompt in prompts:
        messages = [
            {"role": "system", "content": system or SYSTEM_PROMPT},
            {"role": "user", "content": prompt},
        ]
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
        yield prompt, tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True).strip()
