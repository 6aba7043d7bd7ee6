"""``kernelize``: give module instances inside one model a faster ``forward``.

A mapping sends a *key* (which module classes) to a *value* (what their instances run); the
forms are listed in ``kernelize``'s docstring and in ``README.md`` ("Mapping forms"). Whatever
the value, only instances inside the model change: their class is never touched, the new
forward is bound with ``types.MethodType`` (``copy.deepcopy`` rebinds it to the copy), each
patched instance carries ``MARK`` = ``(op, backend)``, and a second call changes nothing."""

import inspect
import itertools
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from twinkle.kernel.config import DEFAULT_KERNEL_CONFIG
from twinkle.kernel.hub_layers import HUB_REF, hub, is_hub_ref, load_hub_layer
from twinkle.kernel.registry import (
    KernelChoice,
    implementations,
    kernels_off,
    op_available,
    registered_ops,
    validate_choice,
)
from twinkle.kernel.switches import MASTER
from twinkle.runtime.remote import RemoteObject  # a model on a device group (single controller)
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

logger = get_logger()
MARK = "_twinkle_kernel"
CUSTOM_OP = "custom"  # the op of a module class or function given as a mapping value
HUB_OP = "hub"  # the op of a layer loaded from the kernels hub
KEY_FORMS = (
    "a module class name ('LlamaRMSNorm'), the module class itself, or its dotted path "
    "('transformers.models.llama.modeling_llama.LlamaRMSNorm')"
)
VALUE_FORMS = (
    "a KernelChoice, an nn.Module subclass (its forward is bound to each instance), a function "
    "forward(self, ...), a hub reference 'owner/repo:LayerName' (or hub(...)), or a dict "
    "{device type: one of these}"
)


@dataclass(frozen=True)
class _Custom:
    """A user's own forward for a module class (a class's ``forward``, a function, a hub layer)."""

    op: str
    backend: str
    forward: Callable[..., Any]
    owner: type | None  # the class ``forward`` came from (None for a function)


@dataclass(frozen=True)
class _Key:
    label: str  # how messages name it (the name, the path, the class's path)
    kind: str  # "name", "path" or "class"
    value: Any

    def matches(self, cls: type) -> bool:
        if self.kind == "class":
            return cls is self.value
        if self.kind == "path":
            return _path(cls) == self.value
        return cls.__name__ == self.value


def _path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _torch_module(model: Any) -> Any:
    """Accept a ``TransformersModel`` facade or a plain ``torch.nn.Module``."""
    return model.model if hasattr(model, "model") and hasattr(model, "optimizer_group") else model


def kernelize(model: Any, mapping: Mapping[Any, Any] | None = None) -> Any:
    """Patch the instances inside ``model`` whose class is a key of ``mapping`` (default
    ``DEFAULT_KERNEL_CONFIG``). Returns ``model``; nothing outside it changes, and calling it
    twice changes nothing more.

    Keys: a class name (``"LlamaRMSNorm"``), a module class (matches instances of exactly that
    class, not subclasses), or a dotted path (``"pkg.module.ClassName"``, matched exactly against
    each class's ``__module__`` and ``__qualname__``). Where several keys match a class, the last
    in the mapping wins (``{**DEFAULT_KERNEL_CONFIG, LlamaRMSNorm: MyNorm}`` overrides).

    Values:

    - ``KernelChoice(op, backends)``: the first available backend whose patch accepts the module;
      none: the module keeps its forward (a failing patch falls through with one warning);
    - an ``nn.Module`` subclass: its ``forward`` is bound to each existing instance, so it reads
      that instance's weights and attributes (its ``__init__`` is never called, nothing is built);
    - a function ``forward(self, *args, **kwargs)``: bound to each instance;
    - a hub layer, ``"owner/repo:LayerName"`` or ``hub(...)``: loaded from the local cache of the
      ``kernels`` package (never downloaded), then bound as a module class;
    - a dict ``{device type: value}``: the entry for the model's device (that of its first
      parameter); no entry: the module keeps its forward.

    The user's own values (class, function, hub layer) are explicit choices: one that cannot be
    used raises ``UserError`` before anything is patched, never falls through. Any other key or
    value form raises ``UserError`` too. With ``TWINKLE_KERNELS=none`` the mapping is checked the
    same way and nothing is patched: every module keeps its own forward."""
    if isinstance(model, RemoteObject):  # a model on a device group: patched on each of its ranks
        return model.run_on_ranks(kernelize, mapping)
    mapping = DEFAULT_KERNEL_CONFIG if mapping is None else mapping
    if not isinstance(mapping, Mapping):
        raise UserError(f"kernel mapping: expected a dict of {{key: value}}, got {type(mapping).__name__}")
    entries = [(_parse_key(key), value) for key, value in mapping.items()]
    for key, value in entries:
        _check_value(key.label, value)
    modules = list(_torch_module(model).modules())
    classes = {type(m) for m in modules}
    for key, _ in entries:
        _check_path_key(key, classes)

    device = _device(modules[0])
    matched: dict[type, int | None] = {}  # module class -> index of the entry it takes
    resolved: dict[int, KernelChoice | _Custom | None] = {}  # entry -> its value, resolved once
    checked: set[tuple[type, int]] = set()
    plan: list[tuple[torch.nn.Module, KernelChoice | _Custom]] = []
    unavailable: set[str] = set()
    already = 0
    for module in modules:  # resolve and check everything before patching anything
        cls = type(module)
        if cls not in matched:
            matched[cls] = next(
                (i for i in reversed(range(len(entries))) if entries[i][0].matches(cls)), None
            )
        index = matched[cls]
        if index is None:
            continue
        if getattr(module, MARK, None):
            already += 1
            continue
        if index not in resolved:
            key, value = entries[index]
            resolved[index] = _resolve(key.label, value, device)
        choice = resolved[index]
        if choice is None:  # a device dict without this device
            unavailable.add(cls.__name__)
            continue
        if isinstance(choice, _Custom) and (cls, index) not in checked:
            _check_binding(repr(entries[index][0].label), choice, module)
            checked.add((cls, index))
        plan.append((module, choice))

    if kernels_off():  # checked like any mapping, patched not at all
        if plan:
            logger.info(f"kernelize: {MASTER}=none: {len(plan)} modules keep their own forwards")
        return model
    counts: dict[tuple[str, str, str], int] = {}  # (target, op, backend) -> instances patched
    failures: dict[tuple[str, str, str], tuple[int, str]] = {}  # -> (instances, last error)
    for module, choice in plan:
        target = type(module).__name__
        if isinstance(choice, _Custom):
            module.forward = types.MethodType(choice.forward, module)
            setattr(module, MARK, (choice.op, choice.backend))
            key = (target, choice.op, choice.backend)
            counts[key] = counts.get(key, 0) + 1
            continue
        for impl in implementations(choice):
            key = (target, impl.op, impl.backend)
            try:
                if not op_available(impl):  # its check and probe, once per process
                    continue
                module.forward = impl.patch(module)
            except Exception as exc:  # an optional kernel failed to check or load: try the next
                n, _ = failures.get(key, (0, ""))
                failures[key] = (n + 1, f"{type(exc).__name__}: {exc}")
                continue
            setattr(module, MARK, (impl.op, impl.backend))
            counts[key] = counts.get(key, 0) + 1
            break
        else:
            unavailable.add(target)
    _log(counts, failures, unavailable, already)
    return model


# ---------------------------------------------------------------------------- keys
def _parse_key(key: Any) -> _Key:
    if isinstance(key, str) and key.isidentifier():
        return _Key(key, "name", key)
    if isinstance(key, str) and all(part.isidentifier() for part in key.split(".")):
        return _Key(key, "path", key)
    if isinstance(key, type) and issubclass(key, torch.nn.Module):
        return _Key(_path(key), "class", key)
    raise UserError(f"kernel mapping key {key!r}: not a module class; a key is {KEY_FORMS}")


def _check_path_key(key: _Key, classes: set[type]) -> None:
    """A dotted path names a class and is matched exactly. One that matches nothing while the
    model has a class of its last part's name (a moved module, a typo in the package), or that
    names a function or an attribute (upstream's module-level replacement: that would patch
    every model in the process), is a mistake: say so rather than patch nothing."""
    if key.kind != "path" or any(key.matches(cls) for cls in classes):
        return
    *_, owner, last = key.value.split(".")
    found = sorted(_path(cls) for cls in classes if cls.__name__ == last)
    if found:
        raise UserError(
            f"kernel mapping key {key.label!r} matches no module of the model, whose {last} is "
            f"{', '.join(found)}: give that path, the class itself or the name {last!r}"
        )
    if last[0].islower() or any(cls.__name__ == owner for cls in classes):
        raise UserError(
            f"kernel mapping key {key.label!r} names a function or an attribute, not a module class: "
            "kernelize patches module instances only; key the module class and give a function "
            "forward(self, ...) as the value"
        )


# ---------------------------------------------------------------------------- values
def _where(label: str, device: str | None) -> str:
    """How a message names an entry: ``'LlamaRMSNorm'``, or ``'LlamaRMSNorm'['cpu']`` in a device dict."""
    return repr(label) if device is None else f"{label!r}[{device!r}]"


def _check_value(label: str, value: Any, device: str | None = None) -> None:
    """The value's form only (cheap, before looking at the model): nothing is loaded here.
    ``device``: the device-dict entry that ``value`` is (a value there cannot be a dict)."""
    where = _where(label, device)
    if isinstance(value, dict) and device is None:
        for entry, inner in value.items():
            if not isinstance(entry, str):
                raise UserError(
                    f"kernel mapping {where}: device key {entry!r} is not a device type ('cpu', 'cuda', ...)"
                )
            _check_value(label, inner, entry)
        return
    if isinstance(value, KernelChoice):
        validate_choice(label, value)
        return
    if isinstance(value, type):
        if not issubclass(value, torch.nn.Module):
            raise UserError(
                f"kernel mapping {where}: class {_path(value)} is not an nn.Module subclass; a value is {VALUE_FORMS}"
            )
        if value.forward is torch.nn.Module.forward:
            raise UserError(f"kernel mapping {where}: {_path(value)} defines no forward")
        return
    if isinstance(value, str):
        if HUB_REF.match(value):
            return
        hint = (
            f"; to choose the registered op {value!r} use KernelChoice({value!r})"
            if value in registered_ops()
            else ""
        )
        raise UserError(
            f"kernel mapping {where}: {value!r} is not a hub reference 'owner/repo:LayerName'{hint}"
        )
    if is_hub_ref(value):
        return
    if isinstance(value, torch.nn.Module):
        raise UserError(
            f"kernel mapping {where}: an instance of {_path(type(value))}; give the class: its forward is "
            "bound to each matched instance and nothing is built"
        )
    if callable(value):
        try:
            inspect.signature(value).bind_partial(object())
        except TypeError:
            raise UserError(
                f"kernel mapping {where}: {_name(value)} takes no positional argument; a function value is forward(self, ...)"
            ) from None
        except ValueError:  # no signature to inspect (some builtins): let it be
            pass
        return
    raise UserError(
        f"kernel mapping {where}: {type(value).__name__} {value!r} is not a kernel; a value is {VALUE_FORMS}"
    )


def _name(value: Any) -> str:
    qualname = getattr(value, "__qualname__", None) or type(value).__qualname__
    module = getattr(value, "__module__", None) or type(value).__module__
    return f"{module}.{qualname}"


def _device(root: torch.nn.Module) -> str:
    """The model's device type: its first parameter's (else buffer's), else ``cpu``."""
    tensor = next(itertools.chain(root.parameters(), root.buffers()), None)
    return "cpu" if tensor is None else tensor.device.type


def _resolve(label: str, value: Any, device: str, entry: str | None = None) -> KernelChoice | _Custom | None:
    """What an (already checked) value means on this model: ``None`` for a device dict without
    ``device``; hub layers are loaded here, once per call."""
    if isinstance(value, dict):
        return _resolve(label, value[device], device, device) if device in value else None
    if isinstance(value, KernelChoice):
        return value
    if isinstance(value, type):
        return _Custom(CUSTOM_OP, _path(value), value.forward, value)
    if isinstance(value, str) or is_hub_ref(value):
        ref = hub(value) if isinstance(value, str) else value
        layer = load_hub_layer(_where(label, entry), ref)
        return _Custom(HUB_OP, str(ref), layer.forward, layer)
    return _Custom(CUSTOM_OP, _name(value), value, None)


def _check_binding(where: str, choice: _Custom, module: torch.nn.Module) -> None:
    """Only a class's ``forward`` is bound to the instance: refuse one that needs more of its
    class (``super()``, helpers the instance lacks) now, rather than fail inside a step."""
    owner = choice.owner
    if owner is None or isinstance(module, owner):
        return
    what = f"kernel mapping {where}: {choice.backend}"
    code = getattr(choice.forward, "__code__", None)
    if code is not None and "__class__" in code.co_freevars:
        raise UserError(
            f"{what}.forward uses super() or __class__, which needs an instance of it; kernelize binds its "
            f"forward to the existing {type(module).__name__} instances: call the parent's forward by name"
        )
    own = set(dir(type(module)))
    helpers = sorted(
        name
        for cls in owner.__mro__
        if cls not in type(module).__mro__ and not issubclass(torch.nn.Module, cls)
        for name, attr in vars(cls).items()
        if name != "forward"
        and not (name.startswith("__") and name.endswith("__"))
        and isinstance(attr, types.FunctionType | property | staticmethod | classmethod)
        and name not in own
        and name not in module.__dict__
    )
    if helpers:
        raise UserError(
            f"{what} defines {', '.join(helpers)}, which {type(module).__name__} instances lack; kernelize "
            "binds only its forward to the existing instances: inline them or use module-level functions"
        )


def _log(
    counts: dict[tuple[str, str, str], int],
    failures: dict[tuple[str, str, str], tuple[int, str]],
    unavailable: set[str],
    already: int,
) -> None:
    """One line per (module class, op, backend), not per instance: 32 layers are one line."""
    for (target, op, backend), (n, reason) in sorted(failures.items()):
        logger.warning(f"kernelize: {op} [{backend}] failed for {n} x {target} ({reason}); fell through")
    for (target, op, backend), n in sorted(counts.items()):
        logger.info(f"kernelize: {n} x {target} -> {op} [{backend}]")
    kept = ", ".join(sorted(unavailable))
    if counts and kept:
        logger.info(f"kernelize: no backend available here for {kept}; they keep their own forward")
    elif not counts and kept:
        logger.info(f"kernelize: no kernel backend is available here for {kept}; model unchanged")
    elif not counts and already:
        logger.info(f"kernelize: all {already} mapped modules were already patched; model unchanged")
    elif not counts:
        logger.info("kernelize: no module of the model is in the kernel mapping; model unchanged")
