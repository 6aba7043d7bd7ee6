"""Vision-language models in ``TransformersModel``: where LoRA goes by default, and which layers
FSDP2 shards apart.

A batch's images run through the vision tower only on the ranks whose rows hold images (a rank
with text rows only, or the pad row of an empty share, skips it). A layer sharded on its own
gathers its weights when it runs, a collective every rank must join, so the vision tower's
blocks stay in the root's unit, gathered with the embedding and the head at the start of every
forward, and only the language model's decoder layers are sharded one by one."""

import copy
from typing import Any


def sharded_layers(lm: Any) -> list[str] | None:
    """The ``_no_split_modules`` classes that FSDP2 shards one by one: all of them for a text
    model; for a model with a vision tower (``config.vision_config``), those inside its language
    model (``get_decoder()``)."""
    names = getattr(lm, "_no_split_modules", None)
    if not names or getattr(lm.config, "vision_config", None) is None or not hasattr(lm, "get_decoder"):
        return names
    text = {type(m).__name__ for m in lm.get_decoder().modules()}
    return [n for n in names if n in text]


# the vision tower and the projector of the families transformers ships, as module names
VISION_MODULES = r"(.*\.)?(visual|vision_tower|vision_model|multi_modal_projector)\..*"


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
