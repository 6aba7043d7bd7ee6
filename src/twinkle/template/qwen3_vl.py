"""``Qwen3VLTemplate``: Qwen3-VL (``Qwen3VLForConditionalGeneration``, and its MoE sibling) and
Qwen3.5's vision path (``Qwen3_5ForConditionalGeneration``, and its MoE sibling).

Upstream Twinkle encodes both with ``Qwen3_5Template``, its one Qwen template that carries a
processor; ``for_model`` gives that name this template when the model is a Qwen3-VL or Qwen3.5
checkpoint with an image processor, so upstream's scripts run unchanged. Qwen3.5 ships Qwen3-VL's
processor (``Qwen3VLProcessor``): the same 16-pixel patches, 2x2 merge and image tokens, so its
rows are Qwen3-VL's."""

from pathlib import Path
from typing import Any

from twinkle.template.vision import VisionTemplate
from twinkle.template.vision_family import folder_of, model_type_of

QWEN3_VL_TYPES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")


class Qwen3VLTemplate(VisionTemplate):
    """Each image becomes ``<|vision_start|>`` + ``<|image_pad|>`` x (t*h*w / merge_size^2) +
    ``<|vision_end|>``, as the model's chat template and processor write it. The numbers differ
    from Qwen2.5-VL's: the image processor cuts 16-pixel patches (14 in Qwen2.5-VL), and the
    model adds features of its early vision blocks at the image tokens of its first decoder layers
    (deepstack), which needs nothing from the row beyond the image tokens. Qwen3-VL's frame
    timestamps are for videos only; rows hold images.

    The model derives its M-RoPE positions from the token types (image or text) beside the
    tokens and grids; the model's forward passes them (``twinkle.model.vision_families``), so a
    row holds the same keys as a Qwen2.5-VL row."""

    IMAGE_TOKEN = "<|image_pad|>"

    def image_tokens(self, grid_thw: Any) -> int:
        t, h, w = (int(v) for v in grid_thw)
        merge = int(getattr(self._processor.image_processor, "merge_size", 2))
        return t * h * w // (merge * merge)


def for_model(cls: type, model_id: Any) -> type:
    """``cls``, or ``Qwen3VLTemplate`` where ``cls`` is ``Qwen3_5Template`` (upstream's name for
    the Qwen vision-language template) and ``model_id`` is a Qwen3-VL or Qwen3.5 checkpoint with
    an image processor. Other models keep ``cls``: a Qwen3 model, or a Qwen3.5 checkpoint without
    an image processor (its language model alone), keeps the text template."""
    from twinkle.template.qwen import Qwen3_5Template

    if cls is not Qwen3_5Template or model_id is None:
        return cls
    folder = folder_of(model_id)
    if folder is None and isinstance(model_id, str):
        from twinkle.hub import resolve_model

        try:
            folder = resolve_model(model_id)
        except Exception:  # the text template reports the id it cannot load
            return cls
    if folder is None or not (Path(folder) / "preprocessor_config.json").is_file():
        return cls
    return Qwen3VLTemplate if model_type_of(folder) in QWEN3_VL_TYPES else cls
