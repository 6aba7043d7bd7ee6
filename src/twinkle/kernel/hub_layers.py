"""Kernels from the Hugging Face kernels hub as ``kernelize`` mapping values: ``hub(...)`` and
``HubRef``, loaded from the ``kernels`` package's local cache only (nothing is downloaded)."""

import importlib.util
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from twinkle.utils.errors import UserError

HUB_REF = re.compile(r"^[\w.-]+/[\w.-]+:[A-Za-z_]\w*$")  # "owner/repo:LayerName"


@dataclass(frozen=True)
class HubRef:
    """A layer of a kernel on the Hugging Face kernels hub, as a mapping value. ``kernelize``
    loads it from the local cache of the ``kernels`` package only: it never downloads."""

    repo_id: str
    layer_name: str
    revision: str | None = None
    version: int | None = None

    def __str__(self) -> str:
        at = f"@{self.revision}" if self.revision else f" version {self.version}" if self.version else ""
        return f"{self.repo_id}:{self.layer_name}{at}"


def hub(ref: str, *, revision: str | None = None, version: int | None = None) -> HubRef:
    """``hub('owner/repo:LayerName', revision=...)``: a hub layer as a mapping value. Give at most
    one of ``revision`` (a branch, tag or commit in the local cache; default ``main``) and
    ``version`` (a kernel version ``N``, looked up as the cached branch ``vN``)."""
    if not isinstance(ref, str) or not HUB_REF.match(ref):
        raise UserError(f"hub reference {ref!r}: expected 'owner/repo:LayerName'")
    if revision is not None and version is not None:
        raise UserError(f"hub reference {ref!r}: give revision or version, not both")
    repo_id, layer_name = ref.rsplit(":", 1)
    return HubRef(repo_id, layer_name, revision, version)


def is_hub_ref(value: Any) -> bool:
    """Our ``HubRef`` or one built elsewhere with the same fields."""
    return all(hasattr(value, field) for field in ("repo_id", "layer_name", "revision", "version"))


def load_hub_layer(where: str, ref: Any) -> type:
    """The layer class of a hub kernel in the ``kernels`` package's local cache; never downloads."""
    asked = f"kernel mapping {where}: hub kernel {ref}"
    try:
        import kernels
    except ImportError:
        raise UserError(
            f"{asked} needs the 'kernels' package, which is not installed; nothing is downloaded "
            "(pip install kernels, fetch the kernel once with network, then run again)"
        ) from None
    if isinstance(ref.version, int) and not isinstance(ref.version, bool):
        revision = f"v{ref.version}"
    elif ref.version is not None:
        raise UserError(
            f"{asked}: a version specifier needs the Hub to resolve; give a cached revision instead"
        )
    else:
        revision = ref.revision or "main"
    install = getattr(kernels, "install_kernel", None)
    if install is None:
        raise UserError(f"{asked}: this 'kernels' package has no install_kernel to read its cache with")
    try:
        package, variant = install(ref.repo_id, revision=revision, local_files_only=True)
    except Exception as exc:
        raise UserError(
            f"{asked} (revision {revision}) is not in the local kernels cache for this machine "
            f"({_first_line(exc)}); nothing is downloaded: fetch it once with network "
            "(kernels.get_kernel or `kernels download`)"
        ) from exc
    try:
        module = _import_package(package, Path(variant) / package / "__init__.py")
    except Exception as exc:
        raise UserError(
            f"{asked} (revision {revision}) is cached but does not import here ({_first_line(exc)})"
        ) from exc
    layer = getattr(getattr(module, "layers", None), ref.layer_name, None)
    if (
        not (isinstance(layer, type) and issubclass(layer, torch.nn.Module))
        or layer.forward is torch.nn.Module.forward
    ):
        raise UserError(
            f"{asked}: the cached kernel has no layer {ref.layer_name!r} (an nn.Module with a forward in its 'layers')"
        )
    return layer


def _first_line(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _import_package(package: str, init: Path) -> types.ModuleType:
    """Import a cached kernel package under a name of its own (two revisions can coexist)."""
    name = f"_twinkle_hub_{package}_{abs(hash(str(init.resolve()))):x}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, init)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {init}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


# ---------------------------------------------------------------------------- logging
