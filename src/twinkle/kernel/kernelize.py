"""``kernelize``: give module instances inside one model a faster ``forward``."""

from typing import Any

from twinkle.kernel.config import DEFAULT_KERNEL_CONFIG
from twinkle.kernel.registry import KernelChoice, implementations, validate_choice
from twinkle.utils.logger import get_logger

logger = get_logger()
_MARK = "_twinkle_kernel"


def _torch_module(model: Any) -> Any:
    """Accept a ``TransformersModel`` facade or a plain ``torch.nn.Module``."""
    return model.model if hasattr(model, "model") and hasattr(model, "optimizer_group") else model


def kernelize(model: Any, mapping: dict[str, KernelChoice] | None = None) -> Any:
    """Patch the instances inside ``model`` whose class name is in ``mapping`` (default
    ``DEFAULT_KERNEL_CONFIG``) with the first available backend of their choice; modules with no
    available backend keep their own forward. Nothing outside ``model`` changes; calling it
    twice changes nothing more. Returns ``model``."""
    mapping = DEFAULT_KERNEL_CONFIG if mapping is None else mapping
    for target, choice in mapping.items():
        validate_choice(target, choice)
    module_root = _torch_module(model)
    counts: dict[tuple[str, str, str], int] = {}
    failures: dict[tuple[str, str, str], tuple[int, str]] = {}
    unavailable: set[str] = set()
    for module in module_root.modules():
        target = type(module).__name__
        if target not in mapping or getattr(module, _MARK, None):
            continue
        for impl in implementations(mapping[target]):
            if not impl.available():
                continue
            key = (target, impl.op, impl.backend)
            try:
                module.forward = impl.patch(module)
            except Exception as exc:  # an optional kernel failed to load: fall through to the next
                n, _ = failures.get(key, (0, ""))
                failures[key] = (n + 1, f"{type(exc).__name__}: {exc}")
                continue
            setattr(module, _MARK, (impl.op, impl.backend))
            counts[key] = counts.get(key, 0) + 1
            break
        else:
            unavailable.add(target)
    # One line per (module class, op, backend), not per instance: a 32-layer model is 32 instances.
    for (target, op, backend), (n, reason) in sorted(failures.items()):
        logger.warning(f"kernelize: {op} [{backend}] failed for {n} x {target} ({reason}); fell through")
    for (target, op, backend), n in sorted(counts.items()):
        logger.info(f"kernelize: {n} x {target} -> {op} [{backend}]")
    if not counts:
        found = ", ".join(sorted(unavailable)) or "no mapped modules"
        logger.info(f"kernelize: no kernel backend is available on this machine for {found}; model unchanged")
    return model
