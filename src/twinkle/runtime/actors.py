"""``GroupWorker``: one rank of a device group under the single controller (``controller``).

Each rank of a group is one Ray actor, one process, which hosts every object the driver created
with ``remote_group=<group>``, at that rank: a model and the DataLoader feeding it live in the
same process, so a batch the loader yields there is read there, never copied. The first object
built in a group sets the process up as a torchrun rank would be (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ... of the group's own process group, then ``twinkle.initialize``), so the
objects inside are the local ones, FSDP2 and all.

Values a method leaves on the ranks (a DataLoader's batch, ``forward_only``'s outputs) are kept
here under a key the driver chose, at most ``KEEP`` per rank (the oldest go first), until a call
of the same group names them (``Kept``) or another group fetches them from Ray's object store
(``share``, then ``Fetched``). An argument that is another object of the group (``Local``) is
that object here; a call whose value is its own object returns ``Itself`` instead of a copy."""

import os
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from twinkle.distributed.collectives import peer_lost
from twinkle.runtime.ray_cluster import free_port_here
from twinkle.utils import logger
from twinkle.utils.errors import UserError

KEEP = 8  # values kept per rank: a step's batch and outputs, with room for a few steps' worth


@dataclass(frozen=True)
class Kept:
    """An argument that is the value kept under ``key`` on the rank the call runs on."""

    key: str


@dataclass(frozen=True)
class Local:
    """An argument that is the object ``oid`` of this group, at the rank the call runs on."""

    oid: str


@dataclass(frozen=True)
class Itself:
    """What a call returns when its value is the object it was called on (the driver then
    returns its proxy instead of a copy of the object)."""


@dataclass(frozen=True)
class Fetched:
    """An argument that is in Ray's object store (``ref``), put there by another group's rank."""

    ref: Any


class GroupWorker:
    """The objects of one group at one rank, and the values they left there."""

    def __init__(self, group: str, rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world
        self.objects: dict[str, Any] = {}
        self.iterators: dict[str, Any] = {}
        self.values: OrderedDict[str, Any] = OrderedDict()

    def __repr__(self) -> str:  # what Ray puts before each of the worker's log lines
        return f"{self.group}{self.rank}"

    def where(self) -> tuple[str, int, int, str]:
        """This worker's node address, a free port on it, its process id and its node's id."""
        import ray

        return (*free_port_here(), os.getpid(), ray.get_runtime_context().get_node_id())

    def setup(
        self, env: dict[str, str], mesh: Any, seed: int, run: Any, cwd: str, initialize: Callable[..., Any]
    ) -> tuple[str, Any]:
        """Become rank ``self.rank`` of the group's process group and initialize the runtime
        (``initialize``: the driver's ``twinkle.initialize``, which Ray sends by name), in the
        driver's working directory where this node has it (relative paths then name the driver's
        files, as they would in one process)."""
        return _guard(lambda: self._setup(env, mesh, seed, run, cwd, initialize))

    def _setup(
        self, env: dict[str, str], mesh: Any, seed: int, run: Any, cwd: str, initialize: Callable[..., Any]
    ) -> None:
        if os.path.isdir(cwd):
            os.chdir(cwd)
        os.environ.update(env)
        logger.reset()  # this process is a rank only from here: the rank's prefix and level
        initialize("local", mesh, seed, run=run)

    def construct(self, oid: str, cls: type, args: tuple, kwargs: dict) -> tuple[str, Any]:
        def build() -> None:
            a, k = self._resolve(args, kwargs)
            self.objects[oid] = cls(*a, **k)

        return _guard(build)

    def call(
        self, oid: str, name: str, args: tuple, kwargs: dict, keep: str | None = None
    ) -> tuple[str, Any]:
        """``name`` on the object (its value for an attribute); with ``keep`` the result stays
        here under that key and the call returns None."""

        def run() -> Any:
            a, k = self._resolve(args, kwargs)
            obj = self.objects[oid]
            value = self._invoke(obj, name, a, k)
            if keep is None:
                return Itself() if value is obj else _portable(value)
            self._keep(keep, value)
            return None

        return _guard(run)

    def repeat(self, oid: str, name: str, args: tuple, kwargs: dict, times: int) -> tuple[str, Any]:
        """Seconds ``times`` calls of ``name`` take here (the driver's overhead is measured against it)."""

        def run() -> float:
            a, k = self._resolve(args, kwargs)
            start = time.perf_counter()
            for _ in range(times):
                self._invoke(self.objects[oid], name, a, k)
            return time.perf_counter() - start

        return _guard(run)

    def start(self, oid: str) -> tuple[str, Any]:
        """A new pass over the object (``iter``)."""

        def begin() -> None:
            self.iterators[oid] = iter(self.objects[oid])

        return _guard(begin)

    def next_into(self, oid: str, key: str) -> tuple[str, Any]:
        """The pass's next item, kept under ``key``; False once the pass is over."""

        def step() -> bool:
            try:
                item = next(self.iterators[oid])
            except StopIteration:
                del self.iterators[oid]
                return False
            self._keep(key, item)
            return True

        return _guard(step)

    def share(self, key: str) -> Any:
        """The value kept under ``key``: Ray stores it for another group's ranks to fetch."""
        return _portable(self.values[key])

    def release(self, oid: str) -> None:
        self.objects.pop(oid, None)
        self.iterators.pop(oid, None)

    # ----------------------------------------------------------------- helpers
    def _invoke(self, obj: Any, name: Any, args: tuple, kwargs: dict) -> Any:
        if callable(name):  # a function of the object (``RemoteObject.run_on_ranks``)
            return name(obj, *args, **kwargs)
        if name == "forward_backward" and hasattr(obj, "forward"):
            return _counted_forward_backward(obj, args, kwargs)
        attr = getattr(obj, name)
        return attr(*args, **kwargs) if callable(attr) else attr

    def _keep(self, key: str, value: Any) -> None:
        self.values[key] = value
        while len(self.values) > KEEP:
            self.values.popitem(last=False)

    def _resolve(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tuple(self._value(a) for a in args), {k: self._value(v) for k, v in kwargs.items()}

    def _value(self, arg: Any) -> Any:
        import ray

        if isinstance(arg, Kept):
            if arg.key not in self.values:
                raise UserError(
                    f"a value of group {self.group!r} is no longer kept on its ranks (each keeps the "
                    f"last {KEEP}); use a batch or output within a few steps of making it"
                )
            return self.values[arg.key]
        if isinstance(arg, Fetched):
            return ray.get(arg.ref)
        if isinstance(arg, Local):
            return self.objects[arg.oid]
        return arg


def _counted_forward_backward(obj: Any, args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """``obj.forward_backward(...)`` and what its ``forward`` counted (supervised tokens, or
    pairs): the driver weighs the ranks' mean losses by it into the global mean."""
    counted: dict[str, Any] = {}
    forward = obj.forward

    def counting(*a: Any, **k: Any) -> Any:
        out = forward(*a, **k)
        counted["n"] = out.get("num_tokens") if isinstance(out, Mapping) else None
        return out

    obj.forward = counting  # this call only: the instance attribute shadows the method
    try:
        return obj.forward_backward(*args, **kwargs), counted.get("n")
    finally:
        del obj.forward


def _portable(value: Any) -> Any:
    """``value`` as it can leave the process: a mapping that computes entries on first read
    (``ModelOutputs``) as a plain dict of what it holds."""
    if isinstance(value, Mapping) and not isinstance(value, dict):
        return {key: value[key] for key in value}
    return value


def _guard(fn: Any) -> tuple[str, Any]:
    """``("ok", value)``; ``("user", line)`` for a ``UserError``; ``("error", line)`` for any other
    exception, whose traceback goes to this worker's log, which Ray also streams to the driver's
    terminal. Not for a collective cut off by another rank's death (``peer_lost``): the driver
    reports that death in one line, and the traceback of every rank left would arrive after it."""
    try:
        return "ok", fn()
    except UserError as exc:
        return "user", " ".join(str(exc).split())
    except Exception as exc:  # noqa: BLE001 - reported to the driver, which raises it there
        if not peer_lost(exc):  # a rank's death is the driver's one line; this would bury it
            traceback.print_exc()
        return "error", f"{type(exc).__name__}: {' '.join(str(exc).split())}"
