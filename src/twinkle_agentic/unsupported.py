"""Names of upstream's experiments that ``twinkle_agentic`` does not build yet: each imports, and
refuses in one line (a ``UserError``) when it is constructed."""

from typing import Any

from twinkle.utils.errors import UserError


def not_supported_yet(name: str, what: str, module: str) -> type:
    """A class named ``name`` whose construction raises ``UserError('<name> is not supported yet:
    <what>')``; ``module`` is where it is imported from (its ``__module__``)."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # refused whatever it is given
        raise UserError(f"{name} is not supported yet: {what}")

    doc = f"Not supported yet: {what}. Constructing it raises ``UserError``."
    return type(name, (), {"__init__": __init__, "__doc__": doc, "__module__": module})
