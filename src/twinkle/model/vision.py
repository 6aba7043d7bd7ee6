"""Vision-language models in ``TransformersModel``: where LoRA goes by default, and which layers
FSDP2 shards apart.

A batch's images run through the vision tower only on the ranks whose rows hold images (a rank
with text rows only, or the pad row of an empty share, skips it). A layer sharded on its own
gathers its weights when it runs, a collective every rank must join, so the vision tower's
blocks stay in the root's unit, gathered with the embedding and the head at the start of every
forward, and only the language model's decoder layers are sharded one by one.

Unsharded CPU training packs frozen weights for oneDNN (``twinkle.kernel.cpu_gemm.pack_frozen``);
the vision tower's and projector's plain linear layers are left dense (``plain_vision_weights``).

The frozen tower (default LoRA) saves nothing for backward: none of its weights requires a
gradient and the pixels never do, so autograd records none of its operations and its activations
are freed as each block finishes."""

import copy
import re
from collections.abc import Mapping
from typing import Any

import torch

from twinkle.model.vision_inputs import check_row_family
from twinkle.utils.errors import UserError


def sharded_layers(lm: Any) -> list[str] | None:
    """The ``_no_split_modules`` classes that FSDP2 shards one by one: all of them for a text
    model; for a model with a vision tower (``config.vision_config``), those inside its language
    model (``get_decoder()``)."""
    names = getattr(lm, "_no_split_modules", None)
    if not names or getattr(lm.config, "vision_config", None) is None or not hasattr(lm, "get_decoder"):
        return names
    text = {type(m).__name__ for m in lm.get_decoder().modules()}
    return [n for n in names if n in text]


# the vision tower and the projector of the families transformers ships, as module names (Gemma 4
# projects with embed_vision, and its audio tower and projector stay frozen as well)
VISION_MODULES = r"(.*\.)?(visual|vision_tower|vision_model|multi_modal_projector|embed_vision|audio_tower|embed_audio)\..*"


def plain_vision_weights(model: Any) -> list[torch.Tensor]:
    """The frozen weights of the plain ``nn.Linear`` layers in ``model``'s vision tower and
    projector (``VISION_MODULES``); a LoRA layer's base layer is not plain. A training step reads
    ``cpu_gemm``'s packed copies only in the fused LoRA nodes and the output head; these layers
    run torch's own ``F.linear`` there, so their copies would sit unread (a sampling or scoring
    pass that routes them through ``cpu_gemm`` takes the dense weight, with the same products),
    and for a tower the size of Qwen2.5-VL's (670M parameters) they would hold 2.5 GiB."""
    inside = re.compile(VISION_MODULES)
    return [
        module.weight
        for name, module in model.named_modules()
        if type(module) is torch.nn.Linear
        and not module.weight.requires_grad
        and inside.fullmatch(name)
        and not name.endswith(".base_layer")
    ]


def language_model_lora(lm: Any, config: Any) -> Any:
    """``config`` (a ``peft.LoraConfig``) for ``lm``: on a model with a vision tower,
    ``target_modules='all-linear'`` means the language model's linear layers, the vision tower
    and projector left frozen (PEFT's own ``all-linear`` takes them too). A config that sets
    ``exclude_modules`` (``[]`` for none) or names its modules is taken as it is: that is how the
    vision tower is trained as well."""
    if getattr(getattr(lm, "config", None), "vision_config", None) is None:
        return config
    if (
        getattr(config, "target_modules", None) != "all-linear"
        or getattr(config, "exclude_modules", None) is not None
    ):
        return config
    config = copy.copy(config)
    config.exclude_modules = VISION_MODULES
    return config


def check_patches(lm: Any, pixel_values: Any) -> None:
    """One line when the rows' image patches are not the size ``lm``'s vision tower cuts: rows
    encoded by another family's template (Qwen2.5-VL's 14-pixel patches on Qwen3-VL's 16-pixel
    tower, or the reverse) would otherwise fail deep inside the tower on a shape."""
    vision = getattr(lm.config, "vision_config", None)
    size = getattr(vision, "patch_size", None)
    temporal = getattr(vision, "temporal_patch_size", None)
    if not isinstance(size, int) or not isinstance(temporal, int) or pixel_values.dim() != 2:
        return
    wanted = getattr(vision, "in_channels", 3) * temporal * size * size
    if pixel_values.shape[-1] != wanted:
        raise UserError(
            f"the rows' images come in patches of {pixel_values.shape[-1]} values, but the vision tower of "
            f"{type(lm).__name__} takes {wanted} ({size}-pixel patches): the rows were encoded for another "
            "model family; encode them with this model's template (--template-cls)"
        )


def check_reads_images(lm: Any, batch: Mapping[str, Any]) -> None:
    """One line, before any forward, when the batch holds images (``pixel_values``: rows encoded
    with a vision-language template) and ``lm`` has no vision tower: a text model would fail deep
    inside on the image tokens' ids, or, where its vocabulary holds them, train on them with the
    pictures silently dropped."""
    if "pixel_values" not in batch:
        return
    if getattr(getattr(lm, "config", None), "vision_config", None) is not None:
        check_row_family(lm, batch)  # rows of a Gemma template on a Qwen model, or the reverse
        return
    counts = batch.get("image_counts")
    where = "the batch holds images"
    if torch.is_tensor(counts):
        where = f"batch row(s) {counts.nonzero()[:, 0].tolist()} hold images"
    kind = getattr(lm.config, "model_type", None) or type(lm).__name__
    raise UserError(
        f"{where} but {kind} has no vision tower; use a vision-language checkpoint "
        "(with its model_cls and template), or encode the rows without images"
    )
