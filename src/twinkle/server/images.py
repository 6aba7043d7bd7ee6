"""Images in Tinker datums and sample prompts, for a vision-language base model:
``Vision.place`` turns each datum's (or prompt's) images into what the model's forward takes,
``pixel_values`` and ``image_grid_thw`` (Gemma 3: one square image each; Gemma 4: its patches and
``image_position_ids``), with the model's image placeholder token repeated once per visual token
where each image sits.

A datum brings its images in one of two ways:

- ``ImageChunk`` in ``model_input`` (the Tinker SDK's): the image's PNG or JPEG bytes between
  text chunks. The server decodes them and runs the model's own image processor (the one its
  vision-language template uses, ``twinkle.template.vision``), so the chunk stands for as many
  placeholder tokens as the processor makes of it (for Qwen2-VL, Qwen2.5-VL and Qwen3-VL,
  ``t*h*w / merge_size^2`` of its patch grid; Gemma 3 a fixed ``mm_tokens_per_image``; Gemma 4
  its pooled patches), which is also what the SDK counts when ``expected_tokens`` is set: a declared
  count that differs is refused rather than trained on shifted targets. The text chunks hold
  the rest of the chat format around it (for Qwen-VL, ``<|vision_start|>`` before the image and
  ``<|vision_end|>`` after it, as the tinker-cookbook renderers write them; for Gemma the
  tokenizer's ``boi_token`` before it and ``eoi_token`` after it).
- ``pixel_values`` and ``image_grid_thw`` in ``loss_fn_inputs``, the placeholders already in the
  text (what ``twinkle.server.common.input_feature_to_datum`` sends for a row a
  vision-language template encoded, as upstream's does): the processed images, checked
  against the placeholders they must fill. A Gemma row carries no grid sizes to check its
  images against: a Gemma base takes ``ImageChunk`` only.

The families placed are the vision-language template tables' (``twinkle.template.vision_family``):
Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Gemma 3, Gemma 4, and Qwen3.5 where its folder holds an image
processor (without one a Qwen3.5 base serves text, as ``TorchSampler`` samples it).

A sample request's prompt is placed as a datum of its own (``ImageChunk`` only: a prompt has no
``loss_fn_inputs``), so it is decoded, processed and checked as training's are.

A datum with an image for a text-only base model, an image that cannot be decoded, a count
that does not match: ``BadRequest`` naming the datum (or the prompt) and the image."""

import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from twinkle.server.errors import BadRequest
from twinkle.server.wire import IMAGE_INPUTS, Datum, ImageIn
from twinkle.template.vision_family import FAMILY_TEMPLATES, GEMMA_TEMPLATES, QWEN3_5_TEMPLATES
from twinkle.utils.errors import UserError

# the vision-language template of each model type whose images the server places: the one its
# rows are encoded with in process (Qwen3-VL's image processor cuts 16-pixel patches, Qwen2-VL's
# and Qwen2.5-VL's 14, so each family counts its own placeholder tokens per image)
FAMILIES = {**FAMILY_TEMPLATES, **QWEN3_5_TEMPLATES, **GEMMA_TEMPLATES}
TEMPLATES = {model_type: template for model_type, (_, template) in FAMILIES.items()}
FORMATS = {"png": "PNG", "jpeg": "JPEG"}  # ImageChunk.format -> PIL's name of it


def _config(model_id: str | None) -> dict[str, Any]:
    """The checkpoint's ``config.json`` (empty for the bundled text model)."""
    if model_id is None:
        return {}
    from twinkle.hub import resolve_model

    path = Path(resolve_model(model_id)) / "config.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def model_cls_of(model_id: str | None) -> str | None:
    """The class a checkpoint with a vision tower is loaded as (its ``architectures[0]``, as
    upstream's server picks it); None for a text model (``AutoModelForCausalLM``)."""
    config = _config(model_id)
    names = config.get("architectures") or []
    return names[0] if config.get("vision_config") is not None and names else None


def load_vision(model_id: str | None) -> "Vision | None":
    """The served model's image path, or None for a text-only model."""
    config = _config(model_id)
    if config.get("vision_config") is None:
        return None
    return Vision(model_id, config)


class Vision:
    """The served model's image processor and tokens (through its vision-language template)."""

    def __init__(self, model_id: str, config: dict[str, Any]):
        self.model_type = config.get("model_type")
        self.template: Any = None
        self.gemma = self.model_type in GEMMA_TEMPLATES  # images without grid sizes
        self.start_id = config.get("vision_start_token_id")
        if self.model_type not in TEMPLATES or not _places_images(model_id, self.model_type):
            return
        from twinkle.template import get_template

        self.template = get_template(TEMPLATES[self.model_type], model_id=model_id)
        self.image_id = int(self.template.image_token_id)
        self.image_token = self.template.image_token
        if self.gemma:  # an image's soft tokens follow the tokenizer's boi_token
            tokenizer = self.template.tokenizer
            self.start_id = int(tokenizer.convert_tokens_to_ids(tokenizer.boi_token))
            return
        processor = self.template.processor.image_processor
        self.patch_width = 3 * int(processor.temporal_patch_size) * int(processor.patch_size) ** 2

    def place(self, data: list[Datum], names: list[str] | None = None) -> None:
        """Each datum's images placed (``tokens`` and ``vision`` set, ``images`` and the image
        inputs taken out), in place. ``names``: what an error calls each datum (``datum i``
        when None; a sample request's prompt is ``prompt``)."""
        for i, d in enumerate(data):
            where = names[i] if names is not None else f"datum {i}"
            sent = {k: d.inputs.pop(k) for k in IMAGE_INPUTS if k in d.inputs}
            if not d.images and not sent:
                self._no_loose_placeholders(d, where, 0)
                continue
            if self.template is None:
                raise BadRequest(
                    f"{where}: images are placed for {', '.join(sorted(TEMPLATES))} models; the served "
                    f"model is {self.model_type}"
                )
            if d.images and sent:
                raise BadRequest(
                    f"{where}: send its images either as ImageChunks or as loss_fn_inputs "
                    f"{' and '.join(IMAGE_INPUTS)}, not both"
                )
            if d.images:
                self._from_chunks(d, where)
            else:
                self._from_inputs(d, where, sent)

    def _no_loose_placeholders(self, d: Datum, where: str, expected: int) -> None:
        if self.template is None:
            return
        found = int((d.tokens == self.image_id).sum())
        if found != expected:
            raise BadRequest(
                f"{where}: model_input holds {found} image placeholder token(s) {self.image_token} "
                f"(id {self.image_id}) where its images take {expected}; send each image as an ImageChunk "
                "in place of its placeholders"
            )

    def _decode(self, image: ImageIn, where: str) -> Any:
        from PIL import Image

        if image.format not in FORMATS:
            raise BadRequest(f"{where}: format {image.format!r} is not one of {', '.join(FORMATS)}")
        try:
            picture = Image.open(io.BytesIO(image.data))
            picture.load()
        except Exception as exc:  # noqa: BLE001 (PIL raises OSError, ValueError, DecompressionBombError)
            raise BadRequest(
                f"{where} ({len(image.data)} bytes of {image.format}) cannot be decoded as an image: {exc}"
            ) from None
        if picture.format != FORMATS[image.format]:
            raise BadRequest(f"{where}: the chunk says {image.format} but the bytes are {picture.format}")
        return picture.convert("RGB")

    def _from_chunks(self, d: Datum, where: str) -> None:
        self._no_loose_placeholders(d, where, 0)
        pictures = [self._decode(image, f"{where}: image {j}") for j, image in enumerate(d.images)]
        try:
            vision, counts = self.template.process_images(pictures)
        except (UserError, ValueError) as exc:  # the processor's limits (an aspect ratio, a size)
            raise BadRequest(f"{where}: the model's image processor refuses its images: {exc}") from None
        parts, last = [], 0
        for j, (image, count) in enumerate(zip(d.images, counts, strict=True)):
            if image.expected is not None and image.expected != count:
                grids = vision.get("image_grid_thw")
                grid = "" if grids is None else " (grid " + "x".join(str(int(v)) for v in grids[j]) + ")"
                raise BadRequest(
                    f"{where}: image {j} is {count} tokens for this model's image processor{grid}, "
                    f"but its chunk declares expected_tokens={image.expected}; declare {count}"
                )
            if self.start_id is not None and (image.at == 0 or int(d.tokens[image.at - 1]) != self.start_id):
                raise BadRequest(
                    f"{where}: image {j} must follow the model's vision start token (id {self.start_id}) "
                    "in the text before it, as the model's chat template writes it"
                )
            parts += [d.tokens[last : image.at], np.full(count, self.image_id, dtype=np.int64)]
            last = image.at
        d.tokens = np.concatenate([*parts, d.tokens[last:]])
        d.images = []
        d.vision = {k: v.numpy() for k, v in vision.items()}

    def _from_inputs(self, d: Datum, where: str, sent: dict[str, np.ndarray]) -> None:
        if self.gemma:
            raise BadRequest(
                f"{where}: a {self.model_type} model's images carry no image_grid_thw to check them by; "
                "send each image as an ImageChunk in place of its soft tokens"
            )
        missing = [k for k in IMAGE_INPUTS if k not in sent]
        if missing:
            raise BadRequest(f"{where}: loss_fn_inputs has {', '.join(sent)} without {missing[0]!r}")
        pixels, grid = sent["pixel_values"], sent["image_grid_thw"]
        if grid.ndim != 2 or grid.shape[1] != 3 or grid.dtype.kind not in "iu" or (grid < 1).any():
            raise BadRequest(
                f"{where}: loss_fn_inputs['image_grid_thw'] must be int64 of shape (images, 3), each "
                f"(t, h, w) at least 1; got {grid.dtype} {list(grid.shape)}"
            )
        patches = int(np.prod(grid, axis=1).sum())
        if pixels.shape != (patches, self.patch_width) or pixels.dtype.kind != "f":
            raise BadRequest(
                f"{where}: loss_fn_inputs['pixel_values'] must be float32 of shape ({patches}, "
                f"{self.patch_width}) for that image_grid_thw and this model's processor; got "
                f"{pixels.dtype} {list(pixels.shape)}"
            )
        if not np.isfinite(pixels).all():
            raise BadRequest(f"{where}: loss_fn_inputs['pixel_values'] holds NaN or inf")
        self._no_loose_placeholders(d, where, sum(self.template.image_tokens(g) for g in grid))
        d.vision = {"pixel_values": pixels.astype(np.float32), "image_grid_thw": grid.astype(np.int64)}


def _places_images(model_id: str, model_type: str) -> bool:
    """Whether a base of a known family places images: Qwen3.5 only with its image processor
    saved beside it (``twinkle.sampler.vision_prefill.image_text_class`` decides the same)."""
    if model_type not in QWEN3_5_TEMPLATES:
        return True
    from twinkle.hub import resolve_model

    return (Path(resolve_model(model_id)) / "preprocessor_config.json").is_file()


def place_images(
    data: list[Datum], vision: Vision | None, served: str, names: list[str] | None = None
) -> None:
    """``Vision.place`` on the served model; for a text-only one, a datum with an image is
    refused. ``names`` as ``Vision.place``'s."""
    if vision is not None:
        vision.place(data, names)
        return
    for i, d in enumerate(data):
        if d.images or any(k in d.inputs for k in IMAGE_INPUTS):
            where = names[i] if names is not None else f"datum {i}"
            raise BadRequest(
                f"{where}: holds an image, but the served base model {served} reads text only; "
                "serve a vision-language model to use images"
            )


__all__ = ["Vision", "load_vision", "model_cls_of", "place_images"]
