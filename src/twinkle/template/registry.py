"""Template names accepted by ``--template-cls``."""

import inspect
from typing import Any

from twinkle.template.base import Template
from twinkle.template.qwen import Qwen3_5Template
from twinkle.utils.errors import UserError

TEMPLATES: dict[str, type[Template]] = {"Template": Template, "Qwen3_5Template": Qwen3_5Template}


def get_template(name_or_class: str | type[Template], model_id: Any = None, **kwargs: Any) -> Template:
    """Build a template by registry name or from a ``Template`` subclass, for ``model_id`` (a
    model id or folder, or a loaded tokenizer); ``kwargs`` are the constructor's keywords, and
    one it does not take is an error naming the ones it does."""
    if isinstance(name_or_class, type) and issubclass(name_or_class, Template):
        cls = name_or_class
    elif isinstance(name_or_class, str) and name_or_class in TEMPLATES:
        cls = TEMPLATES[name_or_class]
    else:
        raise UserError(
            f"--template-cls: unknown template {name_or_class!r}; valid names: {', '.join(TEMPLATES)}"
        )
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "model_id")]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise UserError(
            f"{cls.__name__}: unknown keyword(s) {', '.join(unknown)}; it takes {', '.join(accepted)}"
        )
    return cls(model_id, **kwargs)
