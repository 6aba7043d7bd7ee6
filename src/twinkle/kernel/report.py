"""``describe(model=None)``: what each op resolves to on this machine, and why (``twinkle kernels``)."""

import platform
from collections import Counter
from typing import Any

import torch

from twinkle.kernel import cpu_gemm, registry, switches
from twinkle.kernel.config import DEFAULT_CALL_CHAINS, DEFAULT_KERNEL_CONFIG
from twinkle.kernel.kernelize import MARK, kernelize
from twinkle.kernel.switches import MASTER

# what each module-op backend's ``available()`` checks, in words
MODULE_BACKEND_NEEDS = {
    "liger": "CUDA and the liger-kernel package",
    "npu": "an Ascend NPU and torch_npu",
    "torch": "nothing",
}


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            cpu = next((ln.split(":", 1)[1].strip() for ln in handle if ln.startswith("model name")), cpu)
    except OSError:
        pass
    parts = [cpu, f"{torch.get_num_threads()} threads", f"torch {torch.__version__}"]
    parts.append(f"vector ISA {torch.backends.cpu.get_cpu_capability()}")
    if torch.cuda.is_available():
        parts.append(f"CUDA {torch.cuda.get_device_name()}")
    return ", ".join(parts)


def _call_ops() -> list[str]:
    head = "call ops (chosen at each call: the first usable backend of its chain that takes it)"
    if registry.kernels_off():
        head += f"; {MASTER}=none: each op's plain backend only"
    lines = [head]
    for op in DEFAULT_CALL_CHAINS:
        chain, usable = registry.table_chain(op), registry.chain(op)
        lines.append(f"  {op}: {' -> '.join(chain)}  (in effect: {' -> '.join(usable) or 'none'})")
        for backend in registry.backends_of(op):
            lines.append(f"    {backend:<8} {registry.state(op, backend)[1]}")
    return lines


def _module_backend(op: str, backend: str, chosen: str | None, seen_chosen: bool) -> str:
    impls = registry._REGISTRY.get(op, {})
    if backend not in impls:
        return "not registered for this op"
    if backend == chosen:
        return "chosen"
    if seen_chosen:
        return "not tried (an earlier backend was chosen)"
    if not impls[backend].available():
        return f"unavailable (needs {MODULE_BACKEND_NEEDS.get(backend, '?')})"
    return "fell through (its patch refused the module; see the warning above)"


def _module_ops(model: Any | None) -> list[str]:
    mapping = DEFAULT_KERNEL_CONFIG
    if model is None:
        lines = ["module ops (kernelize; DEFAULT_KERNEL_CONFIG), without a model:"]
        if registry.kernels_off():
            lines[0] += f" none patched ({MASTER}=none); would be:"
        for target, choice in mapping.items():
            states = []
            for backend in choice.backends:
                impl = registry._REGISTRY.get(choice.op, {}).get(backend)
                ok = impl is not None and impl.available()
                states.append(f"{backend} {'available' if ok else 'unavailable'}")
            lines.append(f"  {target} -> {choice.op}: {', '.join(states)}")
        return lines
    kernelize(model)
    found = Counter(type(m).__name__ for m in model.modules() if type(m).__name__ in mapping)
    marks = {type(m).__name__: getattr(m, MARK, None) for m in model.modules() if type(m).__name__ in mapping}
    lines = ["module ops (kernelize; DEFAULT_KERNEL_CONFIG) in this model:"]
    if registry.kernels_off():
        lines += [f"  {n} x {target} -> own forward ({MASTER}=none)" for target, n in sorted(found.items())]
        return lines
    if not found:
        lines.append("  none of the model's module classes is mapped: it keeps its own forwards")
    for target, count in sorted(found.items()):
        choice = mapping[target]
        chosen = marks[target][1] if marks[target] else None
        lines.append(f"  {count} x {target} -> {choice.op} [{chosen or 'own forward'}]")
        seen = False
        for backend in choice.backends:
            lines.append(f"    {backend:<8} {_module_backend(choice.op, backend, chosen, seen)}")
            seen = seen or backend == chosen
    return lines


def _gemm_choices(model: Any) -> list[str]:
    """Which library each frozen weight shape's products use here (by the switch, or in ``auto``
    measured or read from the cache)."""
    if not cpu_gemm.onednn_enabled():
        why = f"{MASTER}=none" if registry.kernels_off() else "oneDNN is not in the chain or not usable here"
        return [f"  cpu_gemm per weight shape: torch for every product ({why})"]
    shapes: dict[tuple[int, int], torch.Tensor] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight.dtype == torch.float32:
            shapes.setdefault(tuple(module.weight.shape), module.weight.detach())
    mode = switches.value("TWINKLE_ONEDNN")
    if mode == "on":
        why = "TWINKLE_ONEDNN=on (the default): oneDNN for every shape"
    else:
        why = "TWINKLE_ONEDNN=auto: measured on this machine (kept in <cache>/gemm/)"
    lines = [f"  cpu_gemm per fp32 weight shape (out x in), {why}:"]
    for shape, weight in sorted(shapes.items()):
        picks = [
            f"{product} {'oneDNN' if cpu_gemm.faster_here(product, weight) else 'torch'}"
            for product in ("linear", "times_weight")
        ]
        lines.append(f"    {shape[0]} x {shape[1]}: {', '.join(picks)}")
    return lines


def describe(model: Any | None = None) -> str:
    """A report of every op: its chain, each backend's state (usable, switched off, unavailable
    and why, failed), and, given a ``torch.nn.Module``, which backend each of its mapped module
    classes got and which library each fp32 weight shape's products use. ``model`` is
    kernelized in place (pass a copy you do not need)."""
    lines = [f"machine: {_machine()}", ""]
    lines += _call_ops()
    if model is not None:
        lines += _gemm_choices(model)
    lines += [""] + _module_ops(model)
    lines += ["", "switches (environment variables; kernel/README.md):"]
    for name, value in switches.values().items():
        default = switches.SWITCHES[name].default
        lines.append(f"  {name}={value}" + ("" if value == default else f"  (default {default})"))
    return "\n".join(lines)
