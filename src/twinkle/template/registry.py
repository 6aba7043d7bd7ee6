"""Template names accepted by ``--template-cls``."""

from typing import Any

from twinkle.template.base import Template
from twinkle.template.qwen import Qwen3_5Template
from twinkle.utils.errors import UserError

TEMPLATES: dict[str, type[Template]] = {"Template": Template, "Qwen3_5Template": Qwen3_5Template}


def get_template(name_or_class: str | type[Template], tokenizer: Any, **kwargs: Any) -> Template:
    """Build a template by registry name or from a ``Template`` subclass."""
    if isinstance(name_or_class, type) and issubclass(name_or_class, Template):
        return name_or_class(tokenizer, **kwargs)
    if name_or_class not in TEMPLATES:
        raise UserError(
            f"--template-cls: unknown template {name_or_class!r}; valid names: {', '.join(TEMPLATES)}"
        )
    return TEMPLATES[name_or_class](tokenizer, **kwargs)
