"""``NoSplitModulesPatch``: name the classes whose instances FSDP2 shards as one unit.

``apply_fsdp2`` (``twinkle.distributed.fsdp``) shards every module whose class name is in the
model's ``_no_split_modules`` (the decoder layers). A model whose class lists none, or lists the
wrong ones (a multimodal wrapper around a text model), is given the names here, on the instance:
the class and every other instance keep their own."""

from typing import Any

from twinkle.patch.base import Patch
from twinkle.utils.errors import UserError

_UNSET = object()


class NoSplitModulesPatch(Patch):
    """``NoSplitModulesPatch({'Qwen3_5DecoderLayer'})(model)`` sets ``model._no_split_modules``."""

    def __init__(
        self, module_names: set[str] | frozenset[str] | list[str] | str = frozenset({"Qwen3_5DecoderLayer"})
    ):
        names = {module_names} if isinstance(module_names, str) else set(module_names)
        if not names or not all(isinstance(n, str) and n for n in names):
            raise UserError(f"NoSplitModulesPatch: give one or more class names, got {module_names!r}")
        self.names = names
        self._before: dict[int, Any] = {}

    def __call__(self, module: Any) -> Any:
        self._before.setdefault(id(module), module.__dict__.get("_no_split_modules", _UNSET))
        module._no_split_modules = set(self.names)
        return module

    def unpatch(self, module: Any) -> Any:
        before = self._before.pop(id(module), _UNSET)
        if before is _UNSET:
            module.__dict__.pop("_no_split_modules", None)
        else:
            module._no_split_modules = before
        return module
