"""``Patch``, and the two ways to apply one: ``apply_patch`` and the ``apply_context`` block."""

import contextlib
from collections.abc import Iterator
from typing import Any

from twinkle.utils.errors import UserError


class Patch:
    """A change to one object: ``__call__(module)`` applies it and returns the module,
    ``unpatch(module)`` reverts it."""

    def __call__(self, module: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define __call__")

    def unpatch(self, module: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} cannot be reverted")


def _instance(patch: Patch | type[Patch]) -> Patch:
    if isinstance(patch, type) and issubclass(patch, Patch):
        return patch()
    if isinstance(patch, Patch):
        return patch
    raise UserError(f"apply_patch: expected a twinkle.patch.Patch or its class, got {patch!r}")


def apply_patch(module: Any, patch: Patch | type[Patch]) -> Any:
    """Apply ``patch`` (an instance, or a class built without arguments) to ``module``."""
    return _instance(patch)(module)


@contextlib.contextmanager
def apply_context(module: Any, patch: Patch | type[Patch]) -> Iterator[Any]:
    """Apply ``patch`` for the block and revert it on the way out, an exception included."""
    instance = _instance(patch)
    result = instance(module)
    try:
        yield result
    finally:
        instance.unpatch(module)
