"""``kernelize``: give module instances inside one model a faster ``forward``."""

from typing import Any

from twinkle.kernel.config import DEFAULT_KERNEL_CONFIG
from twinkle.kernel.registry import KernelChoice, implementations, validate_choice
from twinkle.utils.logger import get_logger

logger = get_logger()
MARK = "_twinkle_kernel"


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
    counts: dict[tuple[str, str, str], int] = {}  # (target, op, backend) -> instances patched
    failures: dict[tuple[str, str, str], tuple[int, str]] = {}  # -> (instances, last error)
    available: dict[tuple[str, str], bool] = {}  # asked once per call, not once per instance
    unavailable: set[str] = set()
    already = 0
    for module in _torch_module(model).modules():
        target = type(module).__name__
        if target not in mapping:
            continue
        if getattr(module, MARK, None):
            already += 1
            continue
        for impl in implementations(mapping[target]):
            key = (target, impl.op, impl.backend)
            try:
                if not available.setdefault((impl.op, impl.backend), bool(impl.available())):
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
