"""The registry: every op Twinkle can compute more than one way, its implementations per
backend, and how one is chosen.

Two kinds of op:

- **module ops** (``rms_norm``, ``swiglu_mlp``, ...): ``kernelize`` gives a module instance the
  forward of the first available backend of its ``KernelChoice``;
- **call ops** (``packed_attention``, ``lora_linear``, ``cpu_gemm``, ...): chosen at each call,
  walking the op's chain (``DEFAULT_CALL_CHAINS``) and taking the first backend that is
  available on this machine, not switched off (``switches.py``), and accepts the call.

Availability is asked once per process and kept. A backend counts as available only if its
check passes and, where it has one, a tiny probe call of it succeeds: a Triton kernel, say,
compiles its launcher with the system's C compiler at its first call, which a machine without
one fails. A failing probe makes the backend unavailable with one warning naming it and the
reason, and the next backend of the chain runs. A backend that fails at run time is taken out
of its chain for the process with one warning (``disable``)."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from twinkle.kernel import switches
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

BACKENDS = ("liger", "npu", "torch")


@dataclass(frozen=True)
class KernelImpl:
    """``available()`` says whether it can run here (device, package); ``patch(module)`` returns the
    new ``forward`` for that module instance (it must compute what the original computes).
    ``probe()``: a tiny call of the kernel, forward and backward, that raises where it cannot run."""

    op: str
    backend: str
    available: Callable[[], bool]
    patch: Callable[[Any], Callable[..., Any]]
    probe: Callable[[], None] | None = None


@dataclass(frozen=True)
class KernelChoice:
    """Use ``op`` for a module, trying ``backends`` in order."""

    op: str
    backends: tuple[str, ...] = BACKENDS


@dataclass(frozen=True)
class CallImpl:
    """One way to compute a call op. ``available()`` is asked once per process; ``requires`` says
    in words what it checks (for ``twinkle kernels``). Whether it takes a given call is the
    op's code's business (shapes, dtypes, a cost model). ``needs``: another backend of the op
    without which this one cannot run."""

    op: str
    backend: str
    available: Callable[[], bool]
    requires: str
    needs: str | None = None
    probe: Callable[[], None] | None = None


_REGISTRY: dict[str, dict[str, KernelImpl]] = {}
_CALLS: dict[str, dict[str, CallImpl]] = {}
_CHAINS: dict[str, tuple[str, ...]] = {}  # call op -> its backends in order of preference
_available: dict[tuple[str, str], bool] = {}
_failed: dict[tuple[str, str], str] = {}  # (op, backend) -> why it was taken out at run time
_usable: dict[tuple[str, str], bool] = {}  # (op, backend) -> in the chain now (cleared on a change)


def register_op(
    op: str,
    backend: str,
    available: Callable[[], bool],
    patch: Callable[[Any], Callable[..., Any]],
    probe: Callable[[], None] | None = None,
) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid backends: {', '.join(BACKENDS)}")
    impls = _REGISTRY.setdefault(op, {})
    if backend in impls:
        raise ValueError(f"op {op!r} already has a {backend!r} implementation")
    impls[backend] = KernelImpl(op, backend, available, patch, probe)


def _checked(op: str, backend: str, available: Callable[[], bool], probe: Callable[[], None] | None) -> bool:
    """``available()`` and then ``probe()``; any exception of either is an unavailable backend
    with one warning, never a crash."""
    try:
        if not available():
            return False
    except Exception as exc:
        get_logger().warning(f"kernel: {op} [{backend}] is unavailable here: {type(exc).__name__}: {exc}")
        return False
    if probe is None:
        return True
    try:
        probe()
    except Exception as exc:
        get_logger().warning(
            f"kernel: {op} [{backend}] failed its probe call ({type(exc).__name__}: {exc}); "
            "using the next backend"
        )
        return False
    return True


def op_available(impl: KernelImpl) -> bool:
    """Whether a module op's implementation can run here: its check and its probe, asked once per
    process."""
    key = (f"module:{impl.op}", impl.backend)
    if key not in _available:
        _available[key] = _checked(impl.op, impl.backend, impl.available, impl.probe)
    return _available[key]


def registered_ops() -> dict[str, tuple[str, ...]]:
    """Every module op (what a ``KernelChoice`` may name) and its registered backends."""
    return {op: tuple(impls) for op, impls in _REGISTRY.items()}


def registered_call_ops() -> dict[str, tuple[str, ...]]:
    """Every call op and its registered backends, in chain order."""
    return {op: tuple(b for b in _CHAINS.get(op, ()) if b in impls) for op, impls in _CALLS.items()}


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


# ---------------------------------------------------------------------------- call ops
def define_call_op(op: str, chain: tuple[str, ...]) -> None:
    """Declare call op ``op`` and the order its backends are tried in (before or after its
    backends register: import order does not matter)."""
    if op in _CHAINS and _CHAINS[op] != chain:
        raise ValueError(f"call op {op!r} is already defined with the chain {_CHAINS[op]}")
    stray = sorted(set(_CALLS.get(op, {})) - set(chain))
    if stray:
        raise ValueError(f"call op {op!r}: registered backends {stray} are not in its chain {chain}")
    _CHAINS[op] = chain
    _CALLS.setdefault(op, {})


def register_call(
    op: str,
    backend: str,
    available: Callable[[], bool],
    requires: str,
    needs: str | None = None,
    probe: Callable[[], None] | None = None,
) -> None:
    if op in _CHAINS and backend not in _CHAINS[op]:
        raise ValueError(f"{backend!r} is not in {op!r}'s chain {_CHAINS[op]}")
    impls = _CALLS.setdefault(op, {})
    if backend in impls:
        raise ValueError(f"op {op!r} already has a {backend!r} implementation")
    impls[backend] = CallImpl(op, backend, available, requires, needs, probe)


def switch_of(op: str, backend: str) -> switches.Switch | None:
    return next((s for s in switches.SWITCHES.values() if (s.op, s.backend) == (op, backend)), None)


def is_available(op: str, backend: str) -> bool:
    """Whether ``backend`` of call op ``op`` can run on this machine: its check and its probe
    call, asked once per process."""
    key = (op, backend)
    if key not in _available:
        impl = _CALLS[op][backend]
        _available[key] = _checked(op, backend, impl.available, impl.probe)
    return _available[key]


def state(op: str, backend: str) -> tuple[bool, str]:
    """``(usable, why)`` for one backend of a call op, as ``twinkle kernels`` reports it."""
    impl = _CALLS[op].get(backend)
    if impl is None:
        return False, "not registered"
    switch = switch_of(op, backend)
    if switch is not None and switches.value(switch.name) == "off":
        return False, f"switched off ({switch.name}=off)"
    if (op, backend) in _failed:
        return False, f"failed, fell through: {_failed[(op, backend)]}"
    if not is_available(op, backend):
        return False, f"unavailable (needs {impl.requires})"
    if impl.needs is not None and not state(op, impl.needs)[0]:
        return False, f"off: it runs on {impl.needs}, which is not usable here"
    mode = "" if switch is None else f" ({switch.name}={switches.value(switch.name)})"
    return True, f"available{mode}"


def enabled(op: str, backend: str) -> bool:
    """Whether ``backend`` is in call op ``op``'s chain now (cheap: asked on hot paths). Asked
    lazily, backend by backend, so a CPU-only backend is never built on a machine whose calls
    never reach it."""
    usable = _usable.get((op, backend))
    if usable is None:
        usable = _usable[(op, backend)] = state(op, backend)[0]
    return usable


def order(op: str) -> tuple[str, ...]:
    """Call op ``op``'s backends in the order they are tried (usable here or not)."""
    return _CHAINS[op]


def chain(op: str) -> tuple[str, ...]:
    """The backends of call op ``op`` usable now, in order of preference."""
    return tuple(b for b in _CHAINS[op] if enabled(op, b))


def disable(op: str, backend: str, reason: str) -> None:
    """Take ``backend`` out of ``op``'s chain for the rest of the process, with one warning."""
    if (op, backend) not in _failed:
        _failed[(op, backend)] = reason
        get_logger().warning(f"kernel: {op} [{backend}] failed ({reason}); using the next in its chain")
    _usable.clear()


def forget() -> None:
    """Ask every backend's availability again (after installing a compiler or a package), and
    give failed backends another chance."""
    _available.clear()
    _failed.clear()
    _usable.clear()


def _forget_chains() -> None:
    _usable.clear()


switches._listeners.append(_forget_chains)
