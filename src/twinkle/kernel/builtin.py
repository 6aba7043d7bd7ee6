"""Upstream's named kernel bundles, ``liger_builtin(model)`` and ``npu_builtin(model)``, as
mappings onto our registry for ``kernelize(model, mapping)``.

Each is ``DEFAULT_KERNEL_CONFIG`` narrowed to the module ops the backend implements here
(``registered_ops()``), its chain cut to that backend then the op's ``torch`` one:

- ``liger_builtin``: ``KernelChoice(op, ("liger", "torch"))`` for every class whose op Liger
  implements. Ungated, as upstream's bundle is: where Liger cannot run (no CUDA, package
  missing) each module takes the torch kernel, the fall-through every chain has.
- ``npu_builtin``: ``{"npu": KernelChoice(op, ("npu", "torch"))}``, gated on the device as
  upstream's values are: on any other device the modules keep their forwards, and ``kernelize``
  lists them in one line as having no kernel for this device.

Both compose by dict merge as upstream's do (``{**npu_builtin(m), **liger_builtin(m)}``: later
keys win). ``model`` is accepted for upstream's call shape and not read: these bundles patch
module instances through ``kernelize`` and change nothing process-wide (upstream's NPU bundle
also swaps the global SDPA function and patches Qwen3.5's linear attention, which no backend
here provides)."""

from typing import Any

from twinkle.kernel.config import DEFAULT_KERNEL_CONFIG
from twinkle.kernel.registry import KernelChoice, registered_ops


def _bundle(backend: str) -> dict[str, KernelChoice]:
    ops = registered_ops()
    return {
        target: KernelChoice(choice.op, (backend, "torch"))
        for target, choice in DEFAULT_KERNEL_CONFIG.items()
        if backend in ops.get(choice.op, ()) and "torch" in ops[choice.op]
    }


def liger_builtin(model: Any = None) -> dict[str, KernelChoice]:
    """Liger's kernels for every module class they cover, torch's where Liger cannot run."""
    return _bundle("liger")


def npu_builtin(model: Any = None) -> dict[str, dict[str, KernelChoice]]:
    """The Ascend kernels for every module class they cover, applied only on an ``npu`` model."""
    return {target: {"npu": choice} for target, choice in _bundle("npu").items()}
