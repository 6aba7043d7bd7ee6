"""``DeviceGroup``: a named set of ranks and the kind of device each of them drives."""

import operator
from collections import Counter
from dataclasses import dataclass

from twinkle.utils.errors import UserError
from twinkle.utils.platform import Platform


@dataclass(frozen=True)
class DeviceGroup:
    """``name``'s ranks, each driving ``gpus_per_worker`` device(s) of ``device_type``.

    ``ranks`` is a list of distinct non-negative ranks, or a count ``n`` for ranks ``0..n-1``;
    it is stored as a tuple. ``device_type`` is a torch device type or a platform name (``cuda``
    or ``GPU``, ``npu``, ``mps``, ``cpu``) and is stored as the torch device type. Each Twinkle
    rank drives one device, so ``gpus_per_worker`` must be 1."""

    name: str
    ranks: tuple[int, ...]
    device_type: str
    gpus_per_worker: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise UserError(f"DeviceGroup: name must be a non-empty string, got {self.name!r}")
        where = f"DeviceGroup {self.name!r}"
        object.__setattr__(self, "ranks", _ranks(self.ranks, where))
        if not isinstance(self.device_type, str):
            raise UserError(
                f"{where}: device_type must be a name such as 'cuda' or 'GPU', got {self.device_type!r}"
            )
        try:
            device_type = Platform.get_platform(self.device_type).device_prefix()
        except UserError as err:
            raise UserError(f"{where}: device_type: {err}") from None
        object.__setattr__(self, "device_type", device_type)
        gpus = _integer(self.gpus_per_worker, f"{where}: gpus_per_worker")
        if gpus < 1:
            raise UserError(f"{where}: gpus_per_worker must be at least 1, got {gpus}")
        if gpus > 1:
            raise UserError(
                f"{where}: gpus_per_worker={gpus} is not supported yet: gpus_per_worker "
                "(each Twinkle rank drives one device; leave it 1)"
            )
        object.__setattr__(self, "gpus_per_worker", gpus)


def _integer(value: object, what: str) -> int:
    if isinstance(value, bool):
        raise UserError(f"{what} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise UserError(f"{what} must be an integer, got {value!r}") from None


def _ranks(ranks: object, where: str) -> tuple[int, ...]:
    if isinstance(ranks, (str, bytes)):
        raise UserError(f"{where}: ranks must be a count or a list of ranks, got {ranks!r}")
    if not hasattr(ranks, "__iter__"):
        count = _integer(ranks, f"{where}: ranks")
        if count < 1:
            raise UserError(f"{where}: ranks must hold at least one rank, got the count {count}")
        return tuple(range(count))
    out = tuple(_integer(rank, f"{where}: each rank") for rank in ranks)
    if not out:
        raise UserError(f"{where}: ranks must hold at least one rank, got none")
    negative = [rank for rank in out if rank < 0]
    if negative:
        raise UserError(f"{where}: ranks must be non-negative, got {negative}")
    repeated = sorted(rank for rank, times in Counter(out).items() if times > 1)
    if repeated:
        raise UserError(f"{where}: ranks must be unique, got {repeated} more than once")
    return out
