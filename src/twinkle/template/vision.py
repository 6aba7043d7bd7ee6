"""Templates for vision-language models: ``VisionTemplate`` (images through the parts of the
model's own ``AutoProcessor``, ``twinkle.template.vision_processor``) and ``Qwen2_5VLTemplate``
(Qwen2-VL / Qwen2.5-VL)."""

from pathlib import Path
from typing import Any

from twinkle.template.base import Segment, Template, TokenIds
from twinkle.template.images import BadImage, image_fields, place_images
from twinkle.template.rows import IGNORE_INDEX, messages_of, without_empty_reply
from twinkle.template.vision_family import check_family
from twinkle.template.vision_processor import VisionProcessor, load_vision_processor
from twinkle.utils.errors import UserError


def _processor_of(model_id: Any) -> tuple[str, VisionProcessor]:
    """``(folder, processor)`` for a model id or folder, or for a tokenizer loaded from one."""
    from twinkle.hub import resolve_model

    if model_id is None:
        raise UserError(
            "a vision-language template needs a vision-language model: pass its model_id "
            "(the bundled model reads text only)"
        )
    if not isinstance(model_id, str | Path):  # a loaded tokenizer: its folder
        name = getattr(model_id, "name_or_path", None)
        if not name or not Path(name).is_dir():
            raise UserError(
                "a vision-language template loads the model's processor from its folder; pass the "
                "model id or folder, not a tokenizer built in memory"
            )
        model_id = name
    folder = str(resolve_model(str(model_id)))
    return folder, load_vision_processor(folder)


class VisionTemplate(Template):
    """Chat messages with images (``Message.images``, placed at their ``<image>`` tags, see
    ``twinkle.template.images``) encoded as the model's own ``AutoProcessor`` encodes them: its
    chat template renders the turns, its image processor turns each image into ``pixel_values``
    and the grid sizes (``image_grid_thw``), and each image's placeholder token is repeated once
    per visual token, so the row's ``input_ids`` line up with what the vision tower produces.

    Labels as ``Template``'s (assistant replies only); image tokens are never supervised. A row
    longer than ``max_length`` is truncated as ``truncation_strategy`` says unless the cut would
    fall on an image's tokens, which is an error naming the row (the image would no longer match
    its tokens). Rows without images encode as text, without ``pixel_values``."""

    IMAGE_TOKEN = ""  # the placeholder token the chat template writes for an image
    encodes_images = True  # samples carry pixel_values, made when a row is read (twinkle.dataset.image_rows)

    def __init__(
        self,
        model_id: Any = None,
        use_chat_template: bool | None = None,
        max_length: int = 1024,
        truncation_strategy: str = "right",
        default_system: str | None = None,
        enable_thinking: bool | None = None,
    ):
        folder, self._processor = _processor_of(model_id)
        check_family(type(self).__name__, folder)
        super().__init__(
            self._processor.tokenizer,
            use_chat_template=use_chat_template,
            max_length=max_length,
            truncation_strategy=truncation_strategy,
            default_system=default_system,
            enable_thinking=enable_thinking,
        )
        self.model_id = str(model_id) if isinstance(model_id, str) else folder
        self.image_token = getattr(self.tokenizer, "image_token", None) or self.IMAGE_TOKEN
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.image_token)
        if self.image_token_id is None or self.image_token_id == self.tokenizer.unk_token_id:
            raise UserError(
                f"{type(self).__name__}: the tokenizer of {self.model_id} has no {self.image_token} token; "
                "is it a model of this family?"
            )

    @property
    def processor(self) -> Any:
        return self._processor

    @property
    def chat_template(self) -> str | None:
        return self._processor.chat_template or getattr(self.tokenizer, "chat_template", None)

    def _check_options(self) -> None:
        name = type(self).__name__
        if self.use_chat_template is False:
            raise UserError(
                f"{name} renders turns with the model's chat template; use_chat_template=False "
                "(plain text) is not supported for images"
            )
        if not self.chat_template:
            raise UserError(f"{name}: the model's processor and tokenizer have no chat template")
        if self.enable_thinking is not None and "enable_thinking" not in self.chat_template:
            raise UserError(
                f"enable_thinking={self.enable_thinking}: this model's chat template has no thinking switch; "
                "leave enable_thinking unset"
            )

    def settings(self) -> dict[str, Any]:
        image_processor = self._processor.image_processor
        keys = ("min_pixels", "max_pixels", "patch_size", "merge_size", "temporal_patch_size")
        return {**super().settings(), "image_processor": {k: getattr(image_processor, k, None) for k in keys}}

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        extra = {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}
        return self.tokenizer.apply_chat_template(
            messages,
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **extra,
        )

    def image_tokens(self, grid_thw: Any) -> int:
        """How many placeholder tokens one image with grid ``(t, h, w)`` takes."""
        raise NotImplementedError

    def process_images(
        self, images: list[Any], index: int | None = None, fields: list[str] | None = None
    ) -> tuple[dict[str, Any], list[int]]:
        """The image processor's tensors for ``images`` and each image's token count. An image
        above the processor's ``max_pixels`` is scaled down to fit, as the model's own processor
        does; one the processor refuses (Qwen's: a side over 200 times the other) is a
        ``BadImage`` naming row ``index`` and the image's field (``fields``, in order)."""
        if not images:
            return {}, []
        try:
            out = self._processor.image_processor(images=images, return_tensors="pt")
        except ValueError as exc:
            raise self._refused(images, index, fields, exc) from None
        grids = out["image_grid_thw"]
        return {"pixel_values": out["pixel_values"], "image_grid_thw": grids}, [
            self.image_tokens(g) for g in grids
        ]

    def _refused(
        self, images: list[Any], index: int | None, fields: list[str] | None, exc: ValueError
    ) -> BadImage:
        """The processor's error on a row's images, naming the image it refuses: each image is
        tried alone (only once the row has failed, so a good row is processed once)."""
        fields = fields or [f"image {k}" for k in range(len(images))]
        for field, image in zip(fields, images, strict=True):
            try:
                self._processor.image_processor(images=[image], return_tensors="pt")
            except ValueError as alone:
                width, height = image.size
                return BadImage(
                    index,
                    field,
                    f": {field} ({width}x{height} pixels) is refused by the model's image processor: "
                    f"{str(alone).rstrip('.')}; crop or pad the image",
                )
        return BadImage(index, "messages", f": the model's image processor refuses the row's images: {exc}")

    def _expand(self, pieces: list[Segment], counts: list[int], index: int | None) -> list[Segment]:
        """Each image placeholder of the rendered pieces repeated to its image's token count."""
        found = sum(text.count(self.image_token) for text, _ in pieces)
        if found != len(counts):
            raise BadImage(
                index,
                "messages",
                f": the chat template wrote {found} image placeholder(s) for {len(counts)} image(s); "
                f"images go in user turns",
            )
        it = iter(counts)
        out = []
        for text, supervised in pieces:
            parts = text.split(self.image_token)
            text = parts[0] + "".join(self.image_token * next(it) + rest for rest in parts[1:])
            out.append((text, supervised))
        return out

    def tokens(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = False, index: int | None = None
    ) -> tuple[list[int], list[int], dict[str, Any]]:
        """``(input_ids, labels, vision)`` of a conversation (the default system added),
        ``vision`` the image processor's ``pixel_values`` and ``image_grid_thw`` (empty without
        images). ``add_generation_prompt``: the prompt the model answers, no label."""
        if add_generation_prompt:
            messages = without_empty_reply(messages)
        # images placed before the default system turn is added: errors name the row's own fields
        turns, images = place_images(messages, index)
        if self.with_default_system(messages) is not messages:
            turns = [{"role": "system", "content": [{"type": "text", "text": self.default_system}]}, *turns]
        vision, counts = self.process_images(images, index, image_fields(messages, index))
        if add_generation_prompt:
            pieces = [(self.render(turns, add_generation_prompt=True), False)]
        else:
            pieces = self.segments(turns)
        input_ids: list[int] = []
        labels: list[int] = []
        for text, supervised in self._expand(pieces, counts, index):
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            input_ids += ids
            labels += [t if supervised and t != self.image_token_id else IGNORE_INDEX for t in ids]
        return input_ids, labels, vision

    def tokenize(self, messages: list[dict[str, Any]], skip_replies: int = 0) -> tuple[list[int], list[int]]:
        if skip_replies:
            raise UserError(f"{type(self).__name__}: preference pairs are not supported yet for images")
        input_ids, labels, _ = self.tokens(messages)
        return input_ids, labels

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.tokens(messages, add_generation_prompt=True)[0]

    def encode(
        self, trajectory: Any, add_generation_prompt: bool = False, index: int | None = None
    ) -> dict[str, Any] | None:
        """``Template.encode`` with images: the row also holds ``pixel_values`` (one row per
        visual patch) and ``image_grid_thw`` (one ``(t, h, w)`` per image)."""
        messages, carried = messages_of(trajectory)
        input_ids, labels, vision = self.tokens(messages, add_generation_prompt, index)
        feature = self._truncate_vision(input_ids, labels, index)
        if feature is None:
            return None
        feature = {
            **feature,
            "input_ids": TokenIds(feature["input_ids"]),
            "labels": TokenIds(feature["labels"]),
            **vision,
        }
        return feature if carried is None else {**carried, **feature}

    def _truncate_vision(
        self, input_ids: list[int], labels: list[int], index: int | None
    ) -> dict[str, Any] | None:
        n, limit = len(input_ids), self.max_length
        if n <= limit or self.truncation_strategy in ("raise", "delete"):
            return self._truncate(input_ids, labels, index)
        cut = input_ids[: n - limit] if self.truncation_strategy == "left" else input_ids[limit:]
        if self.image_token_id in cut:
            raise BadImage(
                index,
                "messages",
                f": {n} tokens, more than --max-length {limit}, and truncation would cut an image's "
                f"tokens; raise --max-length or use smaller images",
            )
        return self._truncate(input_ids, labels, index)


class Qwen2_5VLTemplate(VisionTemplate):
    """Qwen2-VL and Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): each image becomes
    ``<|vision_start|>`` + ``<|image_pad|>`` x (t*h*w / merge_size^2) + ``<|vision_end|>``, as
    the model's chat template and processor write it."""

    IMAGE_TOKEN = "<|image_pad|>"

    def image_tokens(self, grid_thw: Any) -> int:
        t, h, w = (int(v) for v in grid_thw)
        merge = int(getattr(self._processor.image_processor, "merge_size", 2))
        return t * h * w // (merge * merge)
