"""Greedy chat with a base model plus a saved LoRA checkpoint."""

from collections.abc import Iterator
from pathlib import Path

import torch

from twinkle.preprocessor.self_cognition import SYSTEM_PROMPT
from twinkle.utils.errors import UserError


def check_max_new_tokens(value: int) -> None:
    """``--max-new-tokens``: generation needs at least one new token."""
    if value < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {value}")


def load_for_chat(model_id: str | None, adapter: str | None):
    """The model (fp32, eval mode) with ``adapter`` applied, and its tokenizer. The adapter is
    checked first (``twinkle.hub.check_adapter_folder``: its config and tensors agree), then the
    model folder (``resolve_model`` runs ``twinkle.hub.check_model_folder``); what transformers
    still refuses becomes one line too."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from twinkle.hub import check_adapter_folder, pretrained_options, resolve_model

    folder = Path(adapter).expanduser() if adapter else None
    if folder is not None:
        if not (folder / "adapter_config.json").is_file():
            raise UserError(
                f"{folder} holds no adapter (adapter_config.json); pass a checkpoint folder to --adapter"
            )
        check_adapter_folder(folder)
    path = resolve_model(model_id)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **pretrained_options())
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, RuntimeError) as exc:
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise UserError(f"cannot load a chat model from {path} ({reason})") from exc
    if folder is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(folder))
    return model.eval(), tokenizer


@torch.no_grad()
def chat(
    model_id: str | None,
    adapter: str | None,
    prompts: list[str],
    system: str | None = None,
    max_new_tokens: int = 64,
    template_cls: str = "Template",
) -> Iterator[tuple[str, str]]:
    """Render each prompt with the template class used in training (``--template-cls``)."""
    from twinkle.template import get_template

    check_max_new_tokens(max_new_tokens)
    model, tokenizer = load_for_chat(model_id, adapter)
    template = get_template(template_cls, tokenizer)
    for prompt in prompts:
        messages = [
            {"role": "system", "content": system or SYSTEM_PROMPT},
            {"role": "user", "content": prompt},
        ]
        text = template.render(messages, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
        yield prompt, tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True).strip()
