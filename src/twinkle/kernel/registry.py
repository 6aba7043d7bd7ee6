"""The registry: for each op, implementations per backend, each with an availability check."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from twinkle.utils.errors import UserError

BACKENDS = ("liger", "npu", "torch")


@dataclass(frozen=True)
class KernelImpl:
    """``available()`` says whether it can run here (device, package); ``patch(module)`` returns the
    new ``forward`` for that module instance (it must compute what the original computes)."""

    op: str
    backend: str
    available: Callable[[], bool]
    patch: Callable[[Any], Callable[..., Any]]


@dataclass(frozen=True)
class KernelChoice:
    """Use ``op`` for a module, trying ``backends`` in order."""

    op: str
    backends: tuple[str, ...] = BACKENDS


_REGISTRY: dict[str, dict[str, KernelImpl]] = {}


def register_op(
    op: str, backend: str, available: Callable[[], bool], patch: Callable[[Any], Callable[..., Any]]
) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid backends: {', '.join(BACKENDS)}")
    impls = _REGISTRY.setdefault(op, {})
    if backend in impls:
        raise ValueError(f"op {op!r} already has a {backend!r} implementation")
    impls[backend] = KernelImpl(op, backend, available, patch)


def registered_ops() -> dict[str, tuple[str, ...]]:
    return {op: tuple(impls) for op, impls in _REGISTRY.items()}


def validate_choice(target: str, choice: KernelChoice) -> None:
    if choice.op not in _REGISTRY:
        raise UserError(
            f"kernel mapping {target!r}: unknown op {choice.op!r}; valid ops: {', '.join(sorted(_REGISTRY))}"
        )
    for backend in choice.backends:
        if backend not in BACKENDS:
            raise UserError(
                f"kernel mapping {target!r}: unknown backend {backend!r}; valid backends: {', '.join(BACKENDS)}"
            )


def implementations(choice: KernelChoice) -> list[KernelImpl]:
    """The registered implementations of ``choice``, in its order (unregistered ones skipped)."""
    impls = _REGISTRY.get(choice.op, {})
    return [impls[b] for b in choice.backends if b in impls]
