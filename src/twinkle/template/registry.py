"""Template names accepted by ``--template-cls``."""

import inspect
from typing import Any

from twinkle.template.base import Template
from twinkle.template.deepseek_v4 import DeepseekV4Template
from twinkle.template.gemma import Gemma3Template, Gemma4Template
from twinkle.template.qwen import Qwen3_5Template
from twinkle.template.qwen3_vl import Qwen3VLTemplate, for_model
from twinkle.template.vision import Qwen2_5VLTemplate
from twinkle.utils.errors import UserError

TEMPLATES: dict[str, type[Template]] = {
    "Template": Template,
    "Qwen3_5Template": Qwen3_5Template,
    "Qwen2_5VLTemplate": Qwen2_5VLTemplate,
    "Qwen3VLTemplate": Qwen3VLTemplate,
    "DeepseekV4Template": DeepseekV4Template,
    "Gemma3Template": Gemma3Template,
    "Gemma4Template": Gemma4Template,
}
# template names upstream's cookbooks use that name a capability not built here
NOT_YET: dict[str, str] = {}


def refuse_not_yet(name: Any) -> None:
    """One line for a template name of ``NOT_YET``, naming what it needs."""
    if isinstance(name, str) and name in NOT_YET:
        raise UserError(
            f"--template-cls: {name} is not supported yet: {NOT_YET[name]}; valid names: {', '.join(TEMPLATES)}"
        )


def get_template(name_or_class: str | type[Template], model_id: Any = None, **kwargs: Any) -> Template:
    """Build a template by registry name or from a ``Template`` subclass, for ``model_id`` (a
    model id or folder, or a loaded tokenizer); ``kwargs`` are the constructor's keywords, and
    one it does not take is an error naming the ones it does."""
    if isinstance(name_or_class, type) and issubclass(name_or_class, Template):
        cls = name_or_class
    elif isinstance(name_or_class, str) and name_or_class in TEMPLATES:
        cls = TEMPLATES[name_or_class]
    else:
        refuse_not_yet(name_or_class)
        raise UserError(
            f"--template-cls: unknown template {name_or_class!r}; valid names: {', '.join(TEMPLATES)}"
        )
    cls = for_model(cls, model_id)  # upstream's Qwen3_5Template names the Qwen3-VL template too
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "model_id")]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise UserError(
            f"{cls.__name__}: unknown keyword(s) {', '.join(unknown)}; it takes {', '.join(accepted)}"
        )
    return cls(model_id, **kwargs)
