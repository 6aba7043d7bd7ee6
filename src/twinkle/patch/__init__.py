"""Patches: small, reversible changes applied to a model object that a script hands over.

Public names: ``Patch`` (``patch(module)`` applies, ``patch.unpatch(module)`` reverts),
``apply_patch(module, patch)``, ``apply_context(module, patch)`` (applied for a ``with`` block),
and ``twinkle.patch.no_split_modules.NoSplitModulesPatch``. A patch changes only the object it is
given, never a class or a module of another library."""

from twinkle.patch.base import Patch, apply_context, apply_patch
from twinkle.patch.no_split_modules import NoSplitModulesPatch

__all__ = ["Patch", "apply_patch", "apply_context", "NoSplitModulesPatch"]
