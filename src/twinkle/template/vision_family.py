"""Which vision-language template encodes which model family, read from the model folder's
``config.json`` (``model_type``).

The families differ in what an image becomes (Qwen2.5-VL cuts 14-pixel patches, Qwen3-VL
16-pixel ones and adds its deepstack features), so rows encoded by one family's template do not
fit another family's vision tower; the mismatch would surface deep inside the model's forward as a
shape error. A template built for a model of another known family is refused in one line naming
the template to use."""

import json
from pathlib import Path
from typing import Any

from twinkle.utils.errors import UserError

# model_type -> (the family's name, its template)
FAMILY_TEMPLATES = {
    "qwen2_vl": ("Qwen2-VL", "Qwen2_5VLTemplate"),
    "qwen2_5_vl": ("Qwen2.5-VL", "Qwen2_5VLTemplate"),
    "qwen3_vl": ("Qwen3-VL", "Qwen3VLTemplate"),
    "qwen3_vl_moe": ("Qwen3-VL-MoE", "Qwen3VLTemplate"),
}
# Qwen3.5 encodes its images as Qwen3-VL; a table of its own: its checkpoints sample and serve
# images only with an image processor saved beside them (else as the text model they also are)
QWEN3_5_TEMPLATES = {
    "qwen3_5": ("Qwen3.5", "Qwen3VLTemplate"),
    "qwen3_5_moe": ("Qwen3.5-MoE", "Qwen3VLTemplate"),
}
# families whose rows carry one pixel_values entry per image and no grid sizes: the server places
# their images from ImageChunks only (there are no grid sizes to check sent pixel_values by)
GEMMA_TEMPLATES = {
    "gemma3": ("Gemma 3", "Gemma3Template"),
    "gemma4": ("Gemma 4", "Gemma4Template"),
}


def model_type_of(folder: str | Path) -> str | None:
    """``config.json``'s ``model_type`` in ``folder``; None when there is none to read."""
    path = Path(folder) / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def check_family(template_name: str, folder: str | Path) -> None:
    """One line when ``folder`` holds a model of a known family that another template encodes."""
    families = {**FAMILY_TEMPLATES, **QWEN3_5_TEMPLATES, **GEMMA_TEMPLATES}
    model_type = model_type_of(folder)
    if model_type not in families:
        return
    family, wanted = families[model_type]
    served = {name for _, name in families.values()}
    if template_name in served and template_name != wanted:
        raise UserError(
            f"{template_name}: {folder} is a {family} model (model_type {model_type}), whose images "
            f"are encoded differently; use --template-cls {wanted}"
        )


def folder_of(model_id: Any) -> Path | None:
    """The local folder of a model id, folder or loaded tokenizer; None when there is none here
    (nothing is downloaded to find out)."""
    name = getattr(model_id, "name_or_path", model_id)
    if not isinstance(name, str | Path) or not name:
        return None
    path = Path(name).expanduser()
    return path if path.is_dir() else None
