"""``VisionProcessor``: what a vision-language model's ``AutoProcessor`` holds for images (its
tokenizer, image processor and chat template), loaded from the model's folder part by part.

The parts are loaded rather than the ``AutoProcessor`` itself because transformers builds a
Qwen-VL processor only with its video processor, and that one needs ``torchvision``, which a
CPU-only install cannot have: the registry's ``torchvision`` wheel is a CUDA build that fails
to import beside the CPU ``torch`` (and, once installed, makes every transformers image
processor fail to import). The image processor is transformers' PIL/numpy implementation of
the model's own (``backend="pil"``), so rows are the same numbers on every machine."""

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinkle.utils.errors import UserError


@dataclass(frozen=True)
class VisionProcessor:
    tokenizer: Any
    image_processor: Any
    chat_template: str | None


def _chat_template(folder: Path, tokenizer: Any) -> str | None:
    """The processor's chat template (``chat_template.jinja``, or ``chat_template.json`` as
    Qwen-VL checkpoints ship it), else the tokenizer's."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    packed = folder / "chat_template.json"
    if packed.is_file():
        template = json.loads(packed.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(template, str):
            return template
    return getattr(tokenizer, "chat_template", None)


@functools.lru_cache(maxsize=4)
def load_vision_processor(folder: str) -> VisionProcessor:
    """The model's tokenizer, PIL image processor and chat template from its ``folder``; one
    line when the folder has no image processor (a text-only model)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    path = Path(folder)
    if not (path / "preprocessor_config.json").is_file():
        raise UserError(
            f"{folder} has no image processor (preprocessor_config.json): a vision-language template "
            "needs a vision-language model"
        )
    image_processor = AutoImageProcessor.from_pretrained(folder, backend="pil")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return VisionProcessor(tokenizer, image_processor, _chat_template(path, tokenizer))
