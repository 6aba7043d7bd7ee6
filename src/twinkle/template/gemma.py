"""``Gemma3Template`` and ``Gemma4Template``: Gemma 3 (``Gemma3ForConditionalGeneration``) and
Gemma 4 (``Gemma4ForConditionalGeneration``) with images, encoded as the family's own
``AutoProcessor`` encodes them (its tokenizer, PIL image processor and chat template:
``twinkle.template.vision_processor``).

The two families write an image differently from the Qwen ones: the chat template writes one
placeholder per image and the processor replaces it with a fixed text around the image's soft
tokens, rather than repeating the placeholder itself.

- Gemma 3: the placeholder is ``<start_of_image>`` (the tokenizer's ``boi_token``); an image
  becomes ``\\n\\n`` + ``boi_token`` + ``image_token`` x ``image_seq_length`` + ``eoi_token`` +
  ``\\n\\n``, every image the same number of soft tokens (the processor's ``image_seq_length``,
  the model's ``mm_tokens_per_image``): the image processor resizes each image to one square.
- Gemma 4: the placeholder is the tokenizer's ``image_token``; an image becomes ``boi_token`` +
  ``image_token`` x n + ``eoi_token``, n the image's own count of soft tokens (its aspect ratio is
  kept: the image processor resizes it to fit ``max_soft_tokens`` pooled patches and pads its
  patches to that budget; ``image_position_ids`` mark the padding).

The model reads which tokens are an image's from ``input_ids`` (its image token), so a row holds
no token types: the model's forward derives them (``twinkle.model.vision_inputs``)."""

import json
from typing import Any

from twinkle.template.images import BadImage
from twinkle.template.vision import VisionTemplate
from twinkle.template.vision_family import folder_of
from twinkle.utils.errors import UserError


class GemmaVisionTemplate(VisionTemplate):
    """What the Gemma families share: the chat template's image placeholder
    (``placeholder``) replaced by each image's text (``image_text``)."""

    PLACEHOLDER_NAME = ""  # the tokenizer attribute naming the chat template's placeholder
    PROCESSOR_KEYS: tuple[str, ...] = ()  # the image processor's settings that decide a row

    def _check_options(self) -> None:
        super()._check_options()
        name = type(self).__name__
        missing = [
            a for a in ("boi_token", "eoi_token", "image_token") if not getattr(self.tokenizer, a, None)
        ]
        if missing:
            raise UserError(
                f"{name}: the tokenizer of {self.model_id or 'this model'} does not name its {', '.join(missing)}; "
                f"is it a {name.removesuffix('Template')} model?"
            )

    @property
    def placeholder(self) -> str:
        """The token the chat template writes for each image."""
        return getattr(self.tokenizer, self.PLACEHOLDER_NAME)

    def image_text(self, count: int) -> str:
        """The text an image with ``count`` soft tokens becomes."""
        raise NotImplementedError

    def image_tokens(self, grid_thw: Any) -> int:
        raise UserError(f"{type(self).__name__}: images carry no grid sizes (image_grid_thw) in this family")

    def settings(self) -> dict[str, Any]:
        image_processor = self._processor.image_processor
        keys = {k: getattr(image_processor, k, None) for k in self.PROCESSOR_KEYS}
        return {**super(VisionTemplate, self).settings(), "image_processor": keys}

    def _expand(
        self, pieces: list[tuple[str, bool]], counts: list[int], index: int | None
    ) -> list[tuple[str, bool]]:
        """Each placeholder of the rendered pieces replaced by its image's text."""
        found = sum(text.count(self.placeholder) for text, _ in pieces)
        if found != len(counts):
            raise BadImage(
                index,
                "messages",
                f": the chat template wrote {found} image placeholder(s) for {len(counts)} image(s); "
                "images go in user turns",
            )
        it = iter(counts)
        out = []
        for text, supervised in pieces:
            parts = text.split(self.placeholder)
            text = parts[0] + "".join(self.image_text(next(it)) + rest for rest in parts[1:])
            out.append((text, supervised))
        return out

    def _run_processor(
        self, images: list[Any], index: int | None, fields: list[str] | None
    ) -> dict[str, Any]:
        try:
            return self._processor.image_processor(images=images, return_tensors="pt")
        except ValueError as exc:
            raise self._refused(images, index, fields, exc) from None


class Gemma3Template(GemmaVisionTemplate):
    """Gemma 3: each image resized to the image processor's square ``size`` (``pixel_values`` of
    ``(images, 3, height, width)``) and written as ``image_seq_length`` soft tokens between
    ``<start_of_image>`` and ``<end_of_image>``, blank lines around them, as ``Gemma3Processor``
    writes it. Pan-and-scan crops (``do_pan_and_scan``) are refused: a crop's tokens and pixels would
    not fit one image per placeholder."""

    PLACEHOLDER_NAME = "boi_token"
    PROCESSOR_KEYS = ("size", "image_mean", "image_std", "resample", "do_pan_and_scan")

    @property
    def image_seq_length(self) -> int:
        """Soft tokens per image: the processor's ``image_seq_length`` (``processor_config.json``),
        else the model's ``mm_tokens_per_image``, else ``Gemma3Processor``'s default of 256."""
        if not hasattr(self, "_image_seq_length"):
            self._image_seq_length = (
                _folder_setting(
                    self.tokenizer,
                    ("processor_config.json", "image_seq_length"),
                    ("config.json", "mm_tokens_per_image"),
                )
                or 256
            )
        return self._image_seq_length

    def image_text(self, count: int) -> str:
        tok = self.tokenizer
        return f"\n\n{tok.boi_token}{tok.image_token * count}{tok.eoi_token}\n\n"

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "image_seq_length": self.image_seq_length}

    def process_images(
        self, images: list[Any], index: int | None = None, fields: list[str] | None = None
    ) -> tuple[dict[str, Any], list[int]]:
        """``pixel_values`` (one square image each) and each image's token count."""
        if not images:
            return {}, []
        if getattr(self._processor.image_processor, "do_pan_and_scan", None):
            raise UserError(
                "Gemma3Template: the image processor sets do_pan_and_scan, whose crops add images the row's "
                "placeholders do not hold; set do_pan_and_scan to false in preprocessor_config.json"
            )
        out = self._run_processor(images, index, fields)
        return {"pixel_values": out["pixel_values"]}, [self.image_seq_length] * len(images)


class Gemma4Template(GemmaVisionTemplate):
    """Gemma 4: each image resized with its aspect ratio kept to at most ``max_soft_tokens``
    pooled patches, its ``patch_size`` patches flattened (``pixel_values`` of ``(images,
    max_patches, 3 * patch_size ** 2)``, padded to the budget) with their ``(x, y)`` positions
    (``image_position_ids``, ``-1`` on the padding), and written as ``<|image>`` + one
    ``image_token`` per soft token + ``<image|>``, as ``Gemma4Processor`` writes it."""

    PLACEHOLDER_NAME = "image_token"
    PROCESSOR_KEYS = (
        "patch_size",
        "max_soft_tokens",
        "pooling_kernel_size",
        "resample",
        "image_mean",
        "image_std",
    )

    def image_text(self, count: int) -> str:
        tok = self.tokenizer
        return f"{tok.boi_token}{tok.image_token * count}{tok.eoi_token}"

    def process_images(
        self, images: list[Any], index: int | None = None, fields: list[str] | None = None
    ) -> tuple[dict[str, Any], list[int]]:
        """``pixel_values``, ``image_position_ids`` and each image's token count."""
        if not images:
            return {}, []
        out = self._run_processor(images, index, fields)
        counts = [int(n) for n in out["num_soft_tokens_per_image"]]
        return {"pixel_values": out["pixel_values"], "image_position_ids": out["image_position_ids"]}, counts


def _folder_setting(tokenizer: Any, *where: tuple[str, str]) -> Any:
    """The first of ``(file, key)`` found in the model's folder (the tokenizer's), else None."""
    folder = folder_of(tokenizer)
    if folder is None:
        return None
    for file, key in where:
        try:
            value = json.loads((folder / file).read_text(encoding="utf-8")).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if value is not None:
            return value
    return None
