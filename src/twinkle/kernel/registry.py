"""The registry: every op Twinkle can compute more than one way, its implementations per
backend, and how one is chosen.

Two kinds of op:

- **module ops** (``rms_norm``, ``swiglu_mlp``, ...): ``kernelize`` gives a module instance the
  forward of the first available backend of its ``KernelChoice``;
- **call ops** (``packed_attention``, ``lora_linear``, ``cpu_gemm``, ...): chosen at each call
  by ``dispatch``, walking the op's chain from the table (``DEFAULT_CALL_CHAINS``, or as
  ``set_call_chains`` set it) and taking the first backend that is available on this machine,
  not switched off (``switches.py``), and accepts the call. Each chain ends with the op's plain
  torch/PEFT backend, which takes every call; with ``TWINKLE_KERNELS=none`` it is all that runs.

Availability is asked once per process and kept. A backend counts as available only if its
check passes and, where it has one, a tiny probe call of it succeeds: a Triton kernel, say,
compiles its launcher with the system's C compiler at its first call, which a machine without
one fails. A failing probe makes the backend unavailable with one warning naming it and the
reason, and the next backend of the chain runs. A backend that fails at run time is taken out
of its chain for the process with one warning (``disable``)."""

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
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
_CHAINS: dict[str, tuple[str, ...]] = {}  # call op -> its backends in order of preference, now
_DEFAULT_CHAINS: dict[str, tuple[str, ...]] = {}  # call op -> its chain in DEFAULT_CALL_CHAINS
_PLAIN: dict[str, str] = {}  # call op -> its plain torch/PEFT backend
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
    """Every call op and its registered backends (``backends_of``)."""
    return {op: backends_of(op) for op in _CHAINS}


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
    """Declare call op ``op`` with its default chain, the order its backends are tried in
    (before or after its backends register: import order does not matter). ``set_call_chains``
    replaces the chain for the process; ``reset_call_chains`` restores the defaults."""
    if op in _DEFAULT_CHAINS and _DEFAULT_CHAINS[op] != tuple(chain):
        raise ValueError(f"call op {op!r} is already defined with the chain {_DEFAULT_CHAINS[op]}")
    _DEFAULT_CHAINS[op] = _CHAINS[op] = tuple(chain)
    _CALLS.setdefault(op, {})


def register_call(
    op: str,
    backend: str,
    available: Callable[[], bool],
    requires: str,
    needs: str | None = None,
    probe: Callable[[], None] | None = None,
    plain: bool = False,
) -> None:
    """Register one way to compute call op ``op``. ``plain``: the op's plain torch/PEFT way, which
    takes every call, closes every chain of the op and is all that runs with
    ``TWINKLE_KERNELS=none``; each op has exactly one."""
    impls = _CALLS.setdefault(op, {})
    if backend in impls:
        raise ValueError(f"op {op!r} already has a {backend!r} implementation")
    if plain and op in _PLAIN:
        raise ValueError(f"op {op!r} already has the plain backend {_PLAIN[op]!r}")
    impls[backend] = CallImpl(op, backend, available, requires, needs, probe)
    if plain:
        _PLAIN[op] = backend


def plain_backend(op: str) -> str:
    """The backend of call op ``op`` that takes every call: its plain torch/PEFT way."""
    return _PLAIN[op]


def _check_chain(op: str, chain: Any) -> tuple[str, ...]:
    """``chain`` as a tuple, or ``UserError`` saying what is wrong with it for call op ``op``."""
    if op not in _CHAINS:
        raise UserError(f"call chains: unknown call op {op!r}; call ops: {', '.join(_CHAINS)}")
    known = tuple(_CALLS[op])
    plain = _PLAIN[op]
    if not isinstance(chain, (tuple, list)) or not all(isinstance(b, str) for b in chain):
        raise UserError(f"call chain of {op!r}: expected a tuple of backend names, e.g. {(plain,)}")
    chain = tuple(chain)
    stray = [b for b in chain if b not in known]
    if stray:
        raise UserError(
            f"call chain of {op!r}: unknown backend {stray[0]!r}; its backends: {', '.join(known)}"
        )
    if len(set(chain)) != len(chain) or not chain or chain[-1] != plain or chain.count(plain) != 1:
        raise UserError(
            f"call chain of {op!r}: {chain} must name each backend once and end with {plain!r}, "
            "the backend that takes every call"
        )
    return chain


def check_call_chains() -> None:
    """Every call op's chain in the table checked as ``set_call_chains`` checks one (the package
    does this once its backends have registered, so an edited ``DEFAULT_CALL_CHAINS`` that cannot
    run fails at import, saying why)."""
    for op, chain in _CHAINS.items():
        _check_chain(op, chain)


def set_call_chains(chains: Mapping[str, Any]) -> None:
    """Replace the chains of the call ops named in ``chains`` (op -> backends in order, ending
    with the op's plain backend) for the rest of the process; every op's next call walks its new
    chain. Every chain is checked before any is set: a bad one is a ``UserError``."""
    checked = {op: _check_chain(op, chain) for op, chain in chains.items()}
    _CHAINS.update(checked)
    _usable.clear()


def reset_call_chains() -> None:
    """Every call op's chain back to its default (``DEFAULT_CALL_CHAINS``)."""
    _CHAINS.update(_DEFAULT_CHAINS)
    _usable.clear()


@contextmanager
def call_chains(chains: Mapping[str, Any]) -> Iterator[None]:
    """``set_call_chains(chains)`` for the duration of a block, then the chains before it."""
    before = dict(_CHAINS)
    set_call_chains(chains)
    try:
        yield
    finally:
        _CHAINS.update(before)
        _usable.clear()


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


def _runnable(op: str, backend: str) -> tuple[bool, str]:
    """``(usable, why)`` for one backend wherever a chain places it: registered, not switched
    off, not failed, available here, and the backend it runs on runnable too."""
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
    if impl.needs is not None and not _runnable(op, impl.needs)[0]:
        return False, f"off: it runs on {impl.needs}, which is not usable here"
    mode = "" if switch is None else f" ({switch.name}={switches.value(switch.name)})"
    return True, f"available{mode}"


def state(op: str, backend: str) -> tuple[bool, str]:
    """``(usable, why)`` for one backend of a call op, as ``twinkle kernels`` reports it."""
    if backend not in order(op):
        if kernels_off() and backend in _CHAINS[op]:
            return False, f"off ({switches.MASTER}=none: only {_PLAIN[op]!r} runs)"
        return False, "not in the chain"
    return _runnable(op, backend)


def enabled(op: str, backend: str) -> bool:
    """Whether ``backend`` is in call op ``op``'s chain now and usable (cheap: asked on hot
    paths). Asked lazily, backend by backend, so a CPU-only backend is never built on a machine
    whose calls never reach it."""
    usable = _usable.get((op, backend))
    if usable is None:
        usable = _usable[(op, backend)] = state(op, backend)[0]
    return usable


def kernels_off() -> bool:
    """``TWINKLE_KERNELS=none``: every op runs its plain torch/PEFT way."""
    return switches.value(switches.MASTER) == "none"


def table_chain(op: str) -> tuple[str, ...]:
    """Call op ``op``'s chain in the table now (``DEFAULT_CALL_CHAINS``, or as set by
    ``set_call_chains``), whatever the master switch says."""
    return _CHAINS[op]


def backends_of(op: str) -> tuple[str, ...]:
    """Every registered backend of call op ``op``: its chain's first, in order, then the rest."""
    chain = _CHAINS[op]
    return tuple(b for b in chain if b in _CALLS[op]) + tuple(b for b in _CALLS[op] if b not in chain)


def order(op: str) -> tuple[str, ...]:
    """Call op ``op``'s backends in the order they are tried (usable here or not): its chain, or
    its plain backend alone with ``TWINKLE_KERNELS=none``."""
    if kernels_off():
        return (_PLAIN[op],)
    return _CHAINS[op]


def chain(op: str) -> tuple[str, ...]:
    """The backends of call op ``op`` usable now, in order of preference."""
    return tuple(b for b in order(op) if enabled(op, b))


def dispatch(op: str, runners: Mapping[str, Callable[..., Any]], *args: Any) -> Any:
    """Compute call op ``op``: walk ``order(op)``, calling each backend's runner with ``args``;
    the first result that is not None is the op's. A runner returns None where its backend does
    not take this call; it asks ``enabled(op, backend)`` itself, after its own cheap checks of
    the call (device, dtype), so a CPU-only backend is never built where no call reaches it. The
    plain backend's runner takes every call (or returns None where the caller runs the plain
    way itself: then so does ``dispatch``)."""
    for backend in order(op):
        out = runners[backend](*args)
        if out is not None:
            return out
    return None


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
