"""``remote_group=``: a class whose objects may live on a device group of the single controller.

``@remote_class`` is the one hook: a decorated class (``TransformersModel``,
``MultiLoraTransformersModel``, ``DataLoader``; any class may opt in) takes ``remote_group=``
in its constructor. Without it, or without a single controller (``controller.active()``), the
object is the local one. With it, the constructor returns a ``RemoteObject``: every rank of the
group builds the real object in its worker (``actors.GroupWorker``), and a method called on
the proxy runs on every rank in parallel and returns:

- ``forward_backward``: the global mean loss, the ranks' losses weighed by what each counted
  (supervised tokens, or pairs), which is what one process given the whole batch returns;
- ``forward``/``forward_only``: a ``Sharded`` value (each rank's outputs stay on that rank),
  or, with ``initialize(lazy_collect=False)``, the ranks' outputs gathered at once;
- anything else: rank 0's value (the ranks agree: the model reduces over them itself); a
  method that returns its object itself (``kernelize(model)``) returns the proxy.

An attribute read on the proxy comes back as it is when it is plain data (numbers, strings,
None, and lists, tuples, sets and dicts of them: ``sampler.merged_keys``); anything else is a
live ``RemoteView`` (``model.optimizer_group['default']``), whose attributes and items are read
again from the ranks at each access (``group.cur_step`` is the current step, as on a local
object) and which, called, runs on every rank.

Arguments: a ``Sharded`` value (a remote DataLoader's batch, a ``forward_only`` output) given to
a call of the same group goes to each rank as that rank's own part, without leaving the process;
given to another group of the same size (or from a group of one rank), each rank fetches its
part from Ray's object store, never through the driver. For ``forward``, ``forward_only`` and
``forward_backward``, a plain list, tensor or dict of tensors is the global batch: each rank
gets its data rank's contiguous slice (``DeviceMesh.get_slice``), as upstream's
``dispatch='slice_dp'`` does. Another object of the same group (``model.add_metric(metric)``,
``TorchSampler(model, remote_group=...)``) is, on each rank, that rank's object. A ``Parts``
value (``Sharded.fetch``: parts held on the driver) goes to each rank as its own part. Other
arguments go to every rank as they are."""

import functools
import inspect
from collections.abc import Mapping
from typing import Any

import torch

from twinkle.distributed.mesh import DeviceMesh
from twinkle.runtime.actors import Fetched, Itself, Kept, Local
from twinkle.utils.errors import UserError

SLICED = ("forward", "forward_only", "forward_backward")  # their list/tensor arguments are the batch
KEPT = ("forward", "forward_only")  # their outputs stay on the ranks (``Sharded``)
PAD = {"labels": -100}  # what a gathered batch's shorter rows are padded with; 0 otherwise


def remote_class(cls: type) -> type:
    """Let ``cls(..., remote_group='name')`` build ``cls`` on the ranks of device group ``name``."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, remote_group: str | None = None, **kwargs: Any) -> None:
        init(self, *args, **kwargs)

    def __new__(klass: type, *args: Any, remote_group: str | None = None, **kwargs: Any) -> Any:
        if remote_group is not None:
            from twinkle.runtime.controller import active

            controller = active()
            if controller is not None:
                return RemoteObject(controller, klass, remote_group, args, kwargs)
        return object.__new__(klass)

    cls.__init__ = __init__
    cls.__new__ = staticmethod(__new__)
    return cls


class Gathered:
    """Read on the driver (indexing, iterating, ``len``), a per-rank value is its parts joined
    (``gather()``)."""

    def gather(self) -> Any:
        raise NotImplementedError

    def __getitem__(self, item: Any) -> Any:
        return self.gather()[item]

    def __iter__(self) -> Any:
        return iter(self.gather())

    def __len__(self) -> int:
        return len(self.gather())


class Sharded(Gathered):
    """A value that lives on the ranks of a group, one part per rank. Reading it on the driver
    (indexing, iterating, ``len``, ``gather()``) fetches the parts and joins them once."""

    def __init__(self, controller: Any, group: str, key: str, only_first: bool = False) -> None:
        self.controller, self.group, self.key = controller, group, key
        self.only_first = only_first  # rank 0's part stands for the value (every rank holds it)
        self._joined: Any = None

    def fetch(self, *keys: str) -> "Parts":
        """The parts, fetched to the driver once and held there (only ``keys`` of each, when
        given): unlike the ranks' values (``KEEP`` a worker), they never age out."""
        parts = self.parts()
        if keys:
            parts = [{key: part[key] for key in keys} for part in parts]
        return Parts(self.group, parts)

    def first(self) -> "Sharded":
        """Rank 0's part alone: what every rank of the receiving group gets (weights, a state)."""
        return Sharded(self.controller, self.group, self.key, only_first=True)

    def parts(self) -> list[Any]:
        workers = self.controller.group(self.group).workers
        workers = workers[:1] if self.only_first else workers
        return self.controller.ray.get([w.share.remote(self.key) for w in workers])

    def gather(self) -> Any:
        if self._joined is None:
            parts = self.parts()
            self._joined = parts[0] if self.only_first else join(parts)
        return self._joined

    def keys(self) -> Any:
        return self.gather().keys()

    def __float__(self) -> float:
        return float(self.gather()["loss"])

    def __repr__(self) -> str:
        return f"Sharded(group={self.group!r})"


class Parts(Gathered):
    """A value of group ``group`` held on the driver, one part per rank (``Sharded.fetch``):
    given to a call of that group, each rank gets its own part, sent from here; read here
    (indexing, iterating, ``len``, ``gather()``), the parts join as ``Sharded``'s do."""

    def __init__(self, group: str, parts: list[Any]) -> None:
        self.group, self.parts = group, parts

    def gather(self) -> Any:
        return join(self.parts)

    def __repr__(self) -> str:
        return f"Parts(group={self.group!r}, {len(self.parts)} part(s))"


class RemoteView:
    """A non-plain attribute of a remote object, or a part of one (see the module docstring):
    each attribute or item read from it is read on the ranks at that moment."""

    def __init__(self, owner: "RemoteObject", path: tuple, kind: str) -> None:
        vars(self).update(_owner=owner, _path=path, _kind=kind)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self._owner._read((*self._path, ("attr", name)))

    def __getitem__(self, key: Any) -> Any:
        return self._owner._read((*self._path, ("item", key)))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._owner._call(_call_at, self._path, args, kwargs)

    def __repr__(self) -> str:
        steps = "".join(f".{k}" if kind == "attr" else f"[{k!r}]" for kind, k in self._path)
        return f"<remote {self._kind} {self._owner._cls.__name__}{steps} on group {self._owner._group!r}>"


class RemoteObject:
    """The driver's handle on an object built on every rank of a device group."""

    def __init__(self, controller: Any, cls: type, group: str, args: tuple, kwargs: dict) -> None:
        state = controller.group(group)
        others = [a for a in (*args, *kwargs.values()) if isinstance(a, RemoteObject) and a._group != group]
        if others:
            raise UserError(
                f"{cls.__name__}(remote_group={group!r}): an object of group {others[0]._group!r} cannot be "
                "given to the constructor of another group's object; build it from a model id on its own "
                "group and send weights with CheckpointEngineManager(model, sampler).sync_weights()"
            )
        args, kwargs = tuple(_local(a) for a in args), {k: _local(v) for k, v in kwargs.items()}
        given = next((a for a in (*args, *kwargs.values()) if isinstance(a, DeviceMesh)), None)
        mesh = controller.mesh_for(state, given)
        controller.ensure_workers(state, mesh)
        vars(self).update(_controller=controller, _cls=cls, _group=group, _oid=controller.new_key())
        self.remote_group, self.device_mesh = group, mesh
        refs = [w.construct.remote(self._oid, cls, args, kwargs) for w in state.workers]
        controller.wait(state, refs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        found = inspect.getattr_static(self._cls, name, None)
        if callable(found) and not isinstance(found, property):
            return functools.partial(self._call, name)
        return self._read((("attr", name),))

    def _read(self, path: tuple) -> Any:
        """The value at ``path`` when it is plain, else a ``RemoteView`` of it."""
        kind, value = self._call(_read_at, path)
        return value if kind == "value" else RemoteView(self, path, value)

    def run_on_ranks(self, fn: Any, *args: Any, keep: bool = False, **kwargs: Any) -> Any:
        """``fn(the object, *args, **kwargs)`` on every rank (``fn`` importable, or a function Ray
        can pickle): rank 0's value, or with ``keep`` the results left on the ranks (``Sharded``)."""
        return self._call(fn, *args, _keep=keep, **kwargs)

    def keep_on_ranks(self, name: str, *args: Any, **kwargs: Any) -> Sharded:
        """``name(*args, **kwargs)`` on every rank, its results left there (``Sharded``)."""
        return self._call(name, *args, _keep=True, **kwargs)

    def time_on_ranks(self, name: str, *args: Any, times: int = 1, **kwargs: Any) -> float:
        """Seconds ``times`` calls of ``name`` take inside rank 0's worker, the driver left out
        (``bench/ray_controller.py`` compares it with the same calls made through the proxy)."""
        controller = self._controller
        state = controller.group(self._group)
        per_rank = [_arguments(controller, state, i, name, args, kwargs) for i in range(state.world)]
        refs = [
            w.repeat.remote(self._oid, name, a, k, times)
            for w, (a, k) in zip(state.workers, per_rank, strict=True)
        ]
        return controller.wait(state, refs)[0]

    def _call(self, name: str, *args: Any, _keep: bool = False, **kwargs: Any) -> Any:
        controller = self._controller
        state = controller.group(self._group)
        per_rank = [_arguments(controller, state, i, name, args, kwargs) for i in range(state.world)]
        keep = controller.new_key() if name in KEPT or _keep else None
        refs = [
            w.call.remote(self._oid, name, a, k, keep)
            for w, (a, k) in zip(state.workers, per_rank, strict=True)
        ]
        values = controller.wait(state, refs)
        if keep is not None:
            kept = Sharded(controller, self._group, keep)
            return kept if controller.lazy_collect or _keep else kept.gather()
        if name == "forward_backward":
            return _weighted_mean(values)
        return self if isinstance(values[0], Itself) else values[0]

    def __iter__(self) -> Any:
        controller = self._controller
        state = controller.group(self._group)
        controller.wait(state, [w.start.remote(self._oid) for w in state.workers])
        while True:
            key = controller.new_key()
            more = controller.wait(state, [w.next_into.remote(self._oid, key) for w in state.workers])
            if not any(more):
                return
            batch = Sharded(controller, self._group, key)
            yield batch if controller.lazy_collect else batch.gather()

    def __len__(self) -> int:
        return self._call("__len__")

    def __repr__(self) -> str:
        return f"<remote {self._cls.__name__} on group {self._group!r}>"


def _arguments(controller: Any, state: Any, rank: int, name: str, args: tuple, kwargs: dict) -> tuple:
    def one(value: Any) -> Any:
        if isinstance(value, Sharded):
            return _routed(controller, value, state, rank)
        if isinstance(value, Parts):
            return _part_of(value, state, rank)
        if isinstance(value, RemoteObject):
            if value._group != state.spec.name:
                raise UserError(
                    f"{getattr(name, '__name__', name)}(): an object of group {value._group!r} cannot be an "
                    f"argument of a method of group {state.spec.name!r}; objects meet on their own group only"
                )
            return Local(value._oid)
        if name in SLICED and state.world > 1:
            return _slice(value, state.mesh, rank)
        return value

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def _local(value: Any) -> Any:
    return Local(value._oid) if isinstance(value, RemoteObject) else value


def _part_of(value: Parts, state: Any, rank: int) -> Any:
    if value.group != state.spec.name or len(value.parts) != state.world:
        raise UserError(
            f"a value held for group {value.group!r} ({len(value.parts)} parts) cannot go to group "
            f"{state.spec.name!r} ({state.world} ranks) part by part; gather() it first"
        )
    return value.parts[rank]


PLAIN = (type(None), bool, int, float, complex, str, bytes)


def _plain(value: Any) -> bool:
    """Whether ``value`` is plain data, which an attribute read returns as it is."""
    if isinstance(value, PLAIN):
        return True
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return False


def _walk(obj: Any, path: tuple) -> Any:
    for kind, key in path:
        obj = getattr(obj, key) if kind == "attr" else obj[key]
    return obj


def _read_at(obj: Any, path: tuple) -> tuple[str, Any]:
    """On a rank: ``("value", v)`` when the value at ``path`` is plain, else ``("view", its type)``."""
    value = _walk(obj, path)
    return ("value", value) if _plain(value) else ("view", type(value).__name__)


def _call_at(obj: Any, path: tuple, args: tuple, kwargs: dict) -> Any:
    """On a rank: the value at ``path`` called."""
    return _walk(obj, path)(*args, **kwargs)


def _routed(controller: Any, value: Sharded, state: Any, rank: int) -> Any:
    """``value``'s part for ``rank`` of ``state``'s group: kept there, or fetched by reference."""
    source = controller.group(value.group)
    if value.only_first:
        return Kept(value.key) if value.group == state.spec.name and rank == 0 else _fetch(source, 0, value)
    if value.group == state.spec.name:
        return Kept(value.key)
    if source.world not in (1, state.world):
        raise UserError(
            f"a value of group {value.group!r} ({source.world} ranks) cannot go to group "
            f"{state.spec.name!r} ({state.world} ranks) part by part; gather() it on the driver first"
        )
    return _fetch(source, 0 if source.world == 1 else rank, value)


def _fetch(source: Any, rank: int, value: Sharded) -> Fetched:
    return Fetched(source.workers[rank].share.remote(value.key))


def sync_weights(
    source: RemoteObject, target: RemoteObject, receive: str, adapter_name: str | None = None
) -> Any:
    """Send ``source``'s LoRA weights (``get_state_dict(adapter_name)``, rank 0's full copy) to
    every rank of ``target``'s group, whose ``receive`` method takes them: through Ray's object
    store, each target rank fetching them itself, never through the driver. Returns rank 0's
    value of ``receive``. The primitive a checkpoint engine's ``sync_weights`` builds on."""
    weights = source.keep_on_ranks("get_state_dict", adapter_name).first()
    return getattr(target, receive)(weights)


def _slice(value: Any, mesh: DeviceMesh, rank: int) -> Any:
    """``rank``'s contiguous part of a global batch, by its data rank; anything else as it is."""
    if isinstance(value, (list, tuple)):
        return value[_part(mesh, rank, len(value))]
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return value[_part(mesh, rank, value.shape[0])]
    if isinstance(value, Mapping):
        lengths = {v.shape[0] for v in value.values() if isinstance(v, torch.Tensor) and v.dim() > 0}
        if len(lengths) == 1:
            part = _part(mesh, rank, lengths.pop())
            return {
                k: v[part] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in value.items()
            }
    return value


def _part(mesh: DeviceMesh, rank: int, length: int) -> slice:
    return mesh.get_slice(length, mesh.get_data_rank_from_global_rank(rank))


def _weighted_mean(values: list[tuple[Any, Any]]) -> Any:
    """The ranks' mean losses, weighed by what each counted, as one mean (rank 0's value when
    they are not numbers with counts)."""
    if not all(isinstance(v, (int, float)) and isinstance(n, int) for v, n in values):
        return values[0][0]
    total = sum(count for _, count in values)
    if not total:
        return float(values[0][0])
    return sum(loss * count for loss, count in values) / total


def join(parts: list[Any]) -> Any:
    """The ranks' parts as one value: lists end to end; tensors along dim 0 (shorter rows padded,
    ``PAD``); dicts key by key, a ``loss`` weighed by ``num_tokens``, which is summed."""
    first = parts[0]
    if isinstance(first, (list, tuple)):
        return [item for part in parts for item in part]
    if isinstance(first, torch.Tensor):
        return _cat(parts, 0)
    if isinstance(first, Mapping):
        out = {}
        for key in first:
            values = [part[key] for part in parts]
            if key == "num_tokens":
                out[key] = sum(values)
            elif key == "loss" and "num_tokens" in first:
                out[key] = _weighted_mean(
                    [(v, part["num_tokens"]) for v, part in zip(values, parts, strict=True)]
                )
            elif isinstance(values[0], torch.Tensor) and values[0].dim() > 0:
                out[key] = _cat(values, PAD.get(key, 0))
            elif isinstance(values[0], (list, tuple)):
                out[key] = join(values)
            else:
                out[key] = values[0]
        return out
    return parts


def _cat(tensors: list[torch.Tensor], pad: int) -> torch.Tensor:
    width = max(t.shape[-1] for t in tensors) if tensors[0].dim() > 1 else None
    if width is not None:
        tensors = [torch.nn.functional.pad(t, (0, width - t.shape[-1]), value=pad) for t in tensors]
    return torch.cat(tensors, dim=0)
