"""``DeviceMesh``: how the processes of a job are arranged (replicate x shard)."""

import functools
import math
import operator
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger
from twinkle.utils.platform import Platform

# the parallel dimensions a mesh plans; Twinkle's models run dp and fsdp, the others are refused
# by the model asked to run them (``refuse_unimplemented``), so a mesh may be planned and shared
MEANING = {
    "tp": "tensor parallelism",
    "pp": "pipeline parallelism",
    "cp": "context parallelism",
    "ep": "expert parallelism",
    "etp": "expert tensor parallelism",
    "vpp": "virtual pipeline parallelism",
    "ulysses": "Ulysses sequence parallelism",
}
# the mesh's dimensions, outermost first: rank = (((pp*dp + dp_i)*fsdp + fsdp_i)*cp + cp_i)*tp + tp_i
LAYOUT = ("pp", "dp", "fsdp", "cp", "tp")
_MESH_DIMS = LAYOUT  # the names upstream's mesh_dim_names may use


def _env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _device_type(device_type: str | None) -> str | None:
    if device_type is None:
        return None
    if not isinstance(device_type, str):
        raise UserError(f"DeviceMesh: device_type must be a name such as 'cuda', got {device_type!r}")
    try:
        return Platform.get_platform(device_type).device_prefix()
    except UserError as err:
        raise UserError(f"DeviceMesh: device_type: {err}") from None


def _size(value: Any, name: str) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        size = operator.index(value)
    except TypeError:
        raise UserError(f"DeviceMesh: {name} must be an integer, got {value!r}") from None
    if size < 1:
        raise UserError(f"DeviceMesh: {name} must be at least 1, got {size}")
    return size


def _sizes_from_mesh(mesh: Any, mesh_dim_names: Any) -> dict[str, int]:
    """The sizes (``LAYOUT`` name -> size) of upstream's ``mesh=`` / ``mesh_dim_names=`` form, checked."""
    if mesh_dim_names is None:
        raise UserError(
            "DeviceMesh: mesh= needs mesh_dim_names=, one name per dimension, e.g. ('dp', 'fsdp')"
        )
    names = (mesh_dim_names,) if isinstance(mesh_dim_names, str) else tuple(mesh_dim_names)
    try:
        ranks = torch.as_tensor(mesh)
    except (TypeError, ValueError, RuntimeError) as err:
        raise UserError(f"DeviceMesh: mesh= must be a (nested) list or array of ranks: {err}") from None
    if ranks.is_floating_point() or ranks.is_complex() or ranks.dtype == torch.bool:
        raise UserError(f"DeviceMesh: mesh= must hold integer ranks, got dtype {ranks.dtype}")
    if len(names) != ranks.dim():
        raise UserError(
            f"DeviceMesh: mesh_dim_names {names} names {len(names)} dimension(s) but mesh= has "
            f"{ranks.dim()} (shape {tuple(ranks.shape)})"
        )
    for name in names:
        if name == "ep":
            raise UserError("DeviceMesh: give expert parallelism as ep_size=, not as a mesh= dimension")
        if name not in LAYOUT:
            raise UserError(f"DeviceMesh: unknown mesh dimension {name!r}; known: {', '.join(LAYOUT)}")
    if len(set(names)) != len(names):
        raise UserError(f"DeviceMesh: mesh_dim_names {names} repeats a name")
    shape = dict(zip(names, ranks.shape, strict=True))
    world = ranks.numel()
    if world == 0:
        raise UserError(f"DeviceMesh: mesh= holds no ranks (shape {tuple(ranks.shape)})")
    # move the dimensions to LAYOUT's order and read the ranks in that order
    found = ranks.permute([names.index(n) for n in LAYOUT if n in shape]).reshape(-1).tolist()
    if sorted(found) != list(range(world)):
        raise UserError(f"DeviceMesh: mesh= must hold each of the ranks 0..{world - 1} once, got {found}")
    if found != list(range(world)):
        raise UserError(
            "DeviceMesh: this rank layout is not supported yet: mesh= must put rank "
            "dp_index * fsdp_size + fsdp_index at each (dp, fsdp) place (generally the order pp, dp, "
            f"fsdp, cp, tp, outermost first), e.g. np.arange({world}).reshape(dp, fsdp) with "
            "mesh_dim_names=('dp', 'fsdp')"
        )
    return {name: int(shape.get(name, 1)) for name in LAYOUT}


@dataclass(frozen=True, init=False)
class DeviceMesh:
    """An arrangement of ranks: ``dp_size`` replicas, each sharded over ``fsdp_size`` ranks, and
    upstream's other dimensions, planned: ``pp_size`` pipeline stages (outermost), ``cp_size``
    context and ``tp_size`` tensor-parallel ranks (innermost), in the order ``LAYOUT``:

        rank = (((pp_rank * dp + dp_rank) * fsdp + fsdp_rank) * cp + cp_rank) * tp + tp_rank

    As upstream documents them: ``ep_size`` splits the world into ``ep_size`` expert groups of
    consecutive ranks (``ep_rank = rank // (world / ep_size)``); ``ulysses_size`` (alias
    ``sp_size``) makes that many consecutive data ranks read the same data, so the data world is
    ``dp * fsdp / ulysses_size``; tp, cp and pp ranks of one replica share their data rank.
    ``etp_size``, ``vpp_size`` and ``sequence_parallel`` are kept as given.

    Build it from the sizes, ``DeviceMesh(fsdp_size=2, dp_size=2)``, or in upstream Twinkle's
    form, ``DeviceMesh(mesh=np.arange(4).reshape(2, 2), mesh_dim_names=('dp', 'fsdp'))``: the
    same mesh. Twinkle's models run dp x fsdp; a model asked to run another dimension above 1
    refuses (``refuse_unimplemented``). ``device_type`` is checked and kept but takes no part in
    equality: the runtime picks the device (cuda > npu > cpu)."""

    fsdp_size: int
    dp_size: int
    device_type: str | None = field(default=None, compare=False)
    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1
    ep_size: int = 1
    ulysses_size: int = 1
    etp_size: int = 1
    vpp_size: int = 1
    sequence_parallel: bool = False

    def __init__(
        self,
        fsdp_size: int | None = None,
        dp_size: int | None = None,
        device_type: str | None = None,
        *,
        mesh: Any = None,
        mesh_dim_names: Any = None,
        tp_size: int | None = None,
        pp_size: int | None = None,
        cp_size: int | None = None,
        ep_size: int | None = None,
        etp_size: int | None = None,
        vpp_size: int | None = None,
        ulysses_size: int | None = None,
        sp_size: int | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        sizes = {"tp": tp_size, "pp": pp_size, "cp": cp_size}
        if mesh is not None:
            if fsdp_size is not None or dp_size is not None or any(v is not None for v in sizes.values()):
                raise UserError("DeviceMesh: give the sizes or mesh=/mesh_dim_names=, not both")
            shape = _sizes_from_mesh(mesh, mesh_dim_names)
            fsdp_size, dp_size = shape["fsdp"], shape["dp"]
            sizes = {name: shape[name] for name in sizes}
        elif mesh_dim_names is not None:
            raise UserError(
                "DeviceMesh: mesh_dim_names= needs mesh= (the ranks, e.g. np.arange(4).reshape(2, 2))"
            )
        elif fsdp_size is None or dp_size is None:
            raise UserError(
                "DeviceMesh needs fsdp_size and dp_size (or mesh= and mesh_dim_names=); "
                "DeviceMesh.from_sizes infers a missing size from the world size"
            )
        if sp_size is not None and ulysses_size is not None and sp_size != ulysses_size:
            raise UserError(f"DeviceMesh: sp_size={sp_size} and ulysses_size={ulysses_size} name one size")
        ulysses_size = sp_size if ulysses_size is None else ulysses_size
        put = functools.partial(object.__setattr__, self)
        put("fsdp_size", _size(fsdp_size, "fsdp_size"))
        put("dp_size", _size(dp_size, "dp_size"))
        put("device_type", _device_type(device_type))
        for name, size in (*sizes.items(), ("ep", ep_size), ("ulysses", ulysses_size)):
            put(f"{name}_size", 1 if size is None else _size(size, f"{name}_size"))
        put("etp_size", 1 if etp_size is None else _size(etp_size, "etp_size"))
        put("vpp_size", 1 if vpp_size is None else _size(vpp_size, "vpp_size"))
        put("sequence_parallel", bool(sequence_parallel))
        _check_divides(self)

    @classmethod
    def from_sizes(
        cls,
        fsdp_size: int | None = None,
        dp_size: int | None = None,
        world_size: int | None = None,
        *,
        device_type: str | None = None,
        **others: Any,
    ) -> "DeviceMesh":
        """Build a mesh; ``fsdp_size`` or ``dp_size`` left ``None`` is inferred from the world size
        divided by the other mesh sizes (``tp_size``, ``pp_size``, ``cp_size``; ``others`` are
        ``DeviceMesh``'s keywords).

        ``world_size`` defaults to ``$WORLD_SIZE`` (set by torchrun and by the Ray workers). A
        process no launcher started (no ``$WORLD_SIZE``: one process, or the driver of a Ray job,
        which starts the workers itself) takes the sizes as given, a size left ``None`` as 1;
        ``initialize`` then checks the mesh against the processes it finds."""
        for flag, size in (("--fsdp-size", fsdp_size), ("--dp-size", dp_size)):
            if size is not None and size < 1:
                raise UserError(f"{flag} must be at least 1, got {size}")
        for name in ("tp_size", "pp_size", "cp_size"):
            if others.get(name) is not None:
                _size(others[name], name)
        if world_size is None and "WORLD_SIZE" not in os.environ:
            return cls(fsdp_size=fsdp_size or 1, dp_size=dp_size or 1, device_type=device_type, **others)
        world = _env_world_size() if world_size is None else world_size
        model_parallel = math.prod(others.get(n) or 1 for n in ("tp_size", "pp_size", "cp_size"))
        if world % model_parallel:
            raise UserError(
                f"tp_size x pp_size x cp_size = {model_parallel} does not divide the {world} process(es) "
                "of this job; change the sizes"
            )
        world //= model_parallel
        fsdp_size, dp_size = _infer(fsdp_size, dp_size, world)
        return cls(fsdp_size=fsdp_size, dp_size=dp_size, device_type=device_type, **others)

    @property
    def world_size(self) -> int:
        return self.pp_size * self.dp_size * self.fsdp_size * self.cp_size * self.tp_size

    def sizes(self) -> dict[str, int]:
        """Every mesh dimension's size, in ``LAYOUT`` order."""
        return {name: getattr(self, f"{name}_size") for name in LAYOUT}

    def rank_coordinates(self, rank: int) -> dict[str, int]:
        """Where ``rank`` sits: its index along every dimension (``tp``, ``pp``, ...), its expert
        group (``ep``), its Ulysses index and its data rank (``data``)."""
        self._check_rank(rank)
        coords, rest = {}, rank
        for name, size in reversed(self.sizes().items()):
            rest, coords[name] = divmod(rest, size)
        coords = {name: coords[name] for name in LAYOUT}
        coords["ep"] = rank // (self.world_size // self.ep_size)
        raw = coords["dp"] * self.fsdp_size + coords["fsdp"]
        coords["data"], coords["ulysses"] = divmod(raw, self.ulysses_size)
        return coords

    def coordinates(self, rank: int) -> tuple[int, int]:
        """(replica index, shard index) of ``rank``."""
        where = self.rank_coordinates(rank)
        return where["dp"], where["fsdp"]

    def unimplemented(self) -> list[str]:
        """``name=size`` of each planned dimension above 1 that Twinkle's models do not run."""
        out = [f"{n}_size={getattr(self, f'{n}_size')}" for n in ("tp", "pp", "cp", "ep", "ulysses")]
        out = [item for item in out if not item.endswith("=1")]
        out += [
            f"{n}_size={getattr(self, f'{n}_size')}"
            for n in ("etp", "vpp")
            if (getattr(self, f"{n}_size") or 1) > 1
        ]
        # Megatron's sequence parallelism splits activations between tensor-parallel ranks: with
        # one tensor-parallel rank there is nothing to split (Megatron turns it off there too)
        return out + (["sequence_parallel=True"] if self.sequence_parallel and self.tp_size > 1 else [])

    def describe(self) -> str:
        if self.world_size == 1:
            return "single process (no sharding)"
        text = f"{self.dp_size} replica(s) x {self.fsdp_size} shard(s)"
        others = [f"{n} {s}" for n, s in self.sizes().items() if n not in ("dp", "fsdp") and s > 1]
        if others:
            text += " x " + " x ".join(others)
        return f"{text} = {self.world_size} ranks"

    # ------------------------------------------------------------ upstream Twinkle's queries

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """dp and fsdp, and pp, cp, tp where they are above 1, in ``LAYOUT`` order."""
        return tuple(n for n, s in self.sizes().items() if n in ("dp", "fsdp") or s > 1)

    @property
    def mesh(self) -> torch.Tensor:
        """The ranks as a tensor over ``mesh_dim_names`` (upstream: a numpy array)."""
        return torch.arange(self.world_size).reshape([self.sizes()[n] for n in self.mesh_dim_names])

    def has_dim(self, dim_name: str) -> bool:
        return dim_name in self.mesh_dim_names

    def get_dim_size(self, dim_name: str) -> int:
        if dim_name in self.mesh_dim_names:
            return self.sizes()[dim_name]
        raise UserError(f"DeviceMesh: no dimension {dim_name!r}; this mesh has {self.mesh_dim_names}")

    def _this_rank(self) -> int | None:
        rank = Platform.get_rank()
        return rank if 0 <= rank < self.world_size else None

    def _this(self, name: str) -> int | None:
        """This process's index along ``name``; None when ``$RANK`` is unset or outside the mesh."""
        rank = self._this_rank()
        return None if rank is None else self.rank_coordinates(rank)[name]

    dp_rank = property(lambda self: self._this("dp"), doc="This process's replica index, or None.")
    fsdp_rank = property(lambda self: self._this("fsdp"), doc="This process's shard index, or None.")
    tp_rank = property(lambda self: self._this("tp"), doc="This process's tensor-parallel index, or None.")
    pp_rank = property(lambda self: self._this("pp"), doc="This process's pipeline stage, or None.")
    cp_rank = property(lambda self: self._this("cp"), doc="This process's context-parallel index, or None.")
    ep_rank = property(lambda self: self._this("ep"), doc="This process's expert group, or None.")
    ulysses_rank = property(lambda self: self._this("ulysses"), doc="This process's Ulysses index, or None.")
    dp_world_size = property(lambda self: self.dp_size)
    fsdp_world_size = property(lambda self: self.fsdp_size)
    tp_world_size = property(lambda self: self.tp_size)
    pp_world_size = property(lambda self: self.pp_size)
    cp_world_size = property(lambda self: self.cp_size)
    ep_world_size = property(lambda self: self.ep_size)
    etp_world_size = property(lambda self: self.etp_size)

    @property
    def is_single_process(self) -> bool:
        return self.world_size == 1 and "RANK" not in os.environ

    @property
    def data_world_size(self) -> int:
        """How many different data streams the job reads: one per replica x shard, over Ulysses."""
        return self.dp_size * self.fsdp_size // self.ulysses_size

    def get_data_rank_from_global_rank(self, global_rank: int) -> int:
        """Which data stream ``global_rank`` reads: ``(replica * fsdp_size + shard) // ulysses_size``."""
        return self.rank_coordinates(global_rank)["data"]

    @property
    def data_rank(self) -> int:
        """This process's data stream (``$RANK``); 0 in a process no launcher started."""
        rank = self._this_rank()
        return 0 if rank is None else self.get_data_rank_from_global_rank(rank)

    def get_slice(self, total_length: int, rank: int | None = None) -> slice:
        """The contiguous part of ``total_length`` items that data rank ``rank`` (default: this
        process's) reads; the first ``total_length % data_world_size`` parts are one longer."""
        world = self.data_world_size
        if rank is None:
            rank = self.data_rank
        if not 0 <= rank < world:
            raise UserError(f"DeviceMesh.get_slice: data rank {rank} is not in 0..{world - 1}")
        base, extra = divmod(total_length, world)
        start = rank * base + min(rank, extra)
        return slice(start, start + base + (1 if rank < extra else 0))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise UserError(
                f"DeviceMesh: rank {rank} is not in this mesh of {self.world_size} rank(s) ({self.describe()})"
            )


def refuse_unimplemented(mesh: DeviceMesh, who: str, runs: tuple[str, ...] = ()) -> None:
    """One line when ``who`` is asked to run a planned dimension it does not implement (``runs``:
    the dimensions beyond dp x fsdp it does run, e.g. ``("ulysses",)``).
    ``sequence_parallel=True`` with ``tp_size=1`` has nothing to split: one warning, then it runs."""
    if mesh.sequence_parallel and mesh.tp_size == 1:
        get_logger().warning(
            "%s: sequence_parallel=True with tp_size=1 has no effect (Megatron sequence parallelism "
            "splits activations between tensor-parallel ranks); ignored",
            who,
        )
    planned = [p for p in mesh.unimplemented() if p.split("_size")[0] not in runs]
    if planned:
        name = planned[0].split("_size")[0].split("=")[0]
        raise UserError(
            f"{who}: not supported yet: {planned[0]} ({MEANING.get(name, 'Megatron sequence parallelism')}); "
            f"it runs dp replicas x fsdp shards only: set {', '.join(p.split('=')[0] for p in planned)} to "
            "1 (or False) in the mesh it is given"
        )


def _check_divides(mesh: DeviceMesh) -> None:
    if mesh.world_size % mesh.ep_size:
        raise UserError(f"DeviceMesh: ep_size={mesh.ep_size} does not divide the {mesh.world_size} ranks")
    data = mesh.dp_size * mesh.fsdp_size
    if data % mesh.ulysses_size:
        raise UserError(
            f"DeviceMesh: ulysses_size={mesh.ulysses_size} does not divide the {data} data ranks (dp x fsdp)"
        )


def _infer(fsdp_size: int | None, dp_size: int | None, world: int) -> tuple[int, int]:
    """``(fsdp_size, dp_size)`` over ``world`` ranks, a missing one inferred."""
    if fsdp_size is None and dp_size is None:
        fsdp_size, dp_size = world, 1
    elif fsdp_size is None:
        fsdp_size = world // dp_size if world % dp_size == 0 else 0
    elif dp_size is None:
        dp_size = world // fsdp_size if world % fsdp_size == 0 else 0
    if fsdp_size * dp_size != world:
        if fsdp_size and dp_size:
            problem = f"--fsdp-size {fsdp_size} x --dp-size {dp_size} = {fsdp_size * dp_size} does not match"
        else:  # a size left to be inferred came out 0: the given one does not divide the world
            flag, given = ("--fsdp-size", fsdp_size) if fsdp_size else ("--dp-size", dp_size)
            problem = f"{flag} {given} does not divide"
        raise UserError(
            f"{problem} the {world} process(es) of this job; launch with torchrun --nproc_per_node "
            f"{max(1, (fsdp_size or 1) * (dp_size or 1))} or change the sizes"
        )
    return fsdp_size, dp_size
