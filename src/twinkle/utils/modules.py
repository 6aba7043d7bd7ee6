"""A model's modules, listed once and kept until its structure changes, and a train/eval switch
that sets each module's flag directly.

``model.modules()`` walks every module (thousands with LoRA on all linears), and ``model.train()``
sets each flag through ``Module.__setattr__``, which checks the parameter, buffer and module
tables first: a switch pays that for each of those modules. A DPO step asks for both a few times (the reference pass in eval mode, the policy's in train mode), and so does every
evaluation.

``modules(root)`` keeps the list until a module of a kept list gets a child (torch's global
registration hook, installed at the first call, sees every module assigned as an attribute,
``add_module``, and every entry of a ``ModuleList`` or ``ModuleDict``). Registrations on other
modules do not count: Hugging Face's models slice their ``ModuleList`` of layers in every forward,
which registers each layer in a new, temporary list. Removing a module registers none, so a list
may still hold a removed one: harmless for the training flags, and code that removes modules and
then lists them calls ``forget(root)``.

``set_training(root, mode)`` is ``root.train(mode)`` for a model whose modules keep torch's own
``train`` (or transformers' ``PreTrainedModel.train`` without hub kernels, which adds nothing
then); any other override of ``train`` gets the real call."""

import weakref
from typing import Any

import torch

_registrations = [0]  # children registered on modules of kept lists since the hook was installed
_hook: list[Any] = []
# root -> (registrations when listed, weak references to its modules and to those whose class
# overrides train()): weak, so that a kept list never keeps a model (or its process groups) alive
_lists: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[int, list, list]]" = weakref.WeakKeyDictionary()
_listed_ids: set[int] = set()  # id() of every module in a kept list (a reused id: one needless listing)


def _registered(module: torch.nn.Module, name: str, submodule: Any) -> None:
    if id(module) in _listed_ids:
        _registrations[0] += 1


def _alive(refs: list[weakref.ref]) -> list[torch.nn.Module]:
    return [m for m in (r() for r in refs) if m is not None]


def _entry(root: torch.nn.Module) -> tuple[int, list, list]:
    if not _hook:
        _hook.append(torch.nn.modules.module.register_module_module_registration_hook(_registered))
    entry = _lists.get(root)
    if entry is None or entry[0] != _registrations[0]:
        listed = list(root.modules())
        overriding = [weakref.ref(m) for m in listed if type(m).train is not torch.nn.Module.train]
        entry = (_registrations[0], [weakref.ref(m) for m in listed], overriding)
        _lists[root] = entry
        _listed_ids.clear()
        _listed_ids.update(id(r()) for kept in list(_lists.values()) for r in kept[1])
    return entry


def modules(root: torch.nn.Module) -> list[torch.nn.Module]:
    """``list(root.modules())``, listed again only after a module of it got a child."""
    return _alive(_entry(root)[1])


def forget(root: torch.nn.Module) -> None:
    """List ``root``'s modules afresh at the next call (after removing modules from it)."""
    _lists.pop(root, None)


def _adds_nothing(module: torch.nn.Module) -> bool:
    """Whether ``module``'s own ``train`` only sets the flags: transformers' model class does more
    only with hub kernels on (it switches their mode)."""
    from transformers import PreTrainedModel

    return (
        isinstance(module, PreTrainedModel)
        and type(module).train is PreTrainedModel.train
        and not getattr(module, "use_kernels", False)
    )


def set_training(root: torch.nn.Module, mode: bool = True) -> None:
    """``root.train(mode)``: every module's ``training`` flag set to ``mode``."""
    _, listed, overriding = _entry(root)
    if not all(_adds_nothing(m) for m in _alive(overriding)):
        root.train(mode)
        return
    for module in _alive(listed):
        if module.training != mode:
            object.__setattr__(module, "training", mode)  # what Module.__setattr__ does for a bool


def any_training(root: torch.nn.Module) -> bool:
    """Whether any module of ``root`` is in training mode."""
    return any(m.training for m in modules(root))
