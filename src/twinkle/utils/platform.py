"""``Platform``: the accelerator this process uses and the launcher's rank variables.

Upstream Twinkle's ``Platform`` queries, answered from torch and the environment. The platform
is picked the way the runtime picks its device (cuda > npu > cpu), so the two always agree; MPS
is answered only when asked for by name. Nothing here initialises a device, except the RNG-state
calls, which read or write the device's generator."""

import os
from typing import Any, ClassVar

import torch

from twinkle.utils.errors import UserError
from twinkle.utils.framework import Torch

DEVICE_TYPES = ("cuda", "npu", "mps", "cpu")
"""The torch device types a ``Platform`` can stand for."""


def _env_int(*names: str, default: int) -> int:
    """The first of ``names`` set (and non-empty) in the environment, as an int; else ``default``."""
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            try:
                return int(value)
            except ValueError:
                raise UserError(f"${name} must be an integer, got {value!r}") from None
    return default


class Platform:
    """Static queries about this machine's accelerator and this process's place in the job.

    Call them on ``Platform`` (the platform of this process, or the one named by ``platform=``:
    ``"GPU"``/``"cuda"``, ``"NPU"``, ``"MPS"``, ``"CPU"``) or on the class ``get_platform``
    returns (``Platform.get_platform().device_prefix()``). Rank queries read torchrun's
    variables; ``get_rank`` and ``get_local_rank`` are -1 in a process no launcher started."""

    _prefix: ClassVar[str] = ""
    _backend: ClassVar[str] = ""
    _visible_env: ClassVar[str | None] = None

    # ------------------------------------------------------------ which platform

    @staticmethod
    def get_platform_names() -> list[str]:
        return list(_BY_NAME_ORDER)

    @staticmethod
    def get_platform(platform: str | None = None) -> "type[Platform]":
        """The platform named by ``platform`` (a platform name or a torch device type, any case),
        or the one this process runs on: cuda > npu > cpu, as the runtime picks its device."""
        if platform is None:
            return _BY_NAME[Torch.device_type().upper()]
        if not isinstance(platform, str):
            raise UserError(f"platform must be a name such as 'GPU' or 'cuda', got {platform!r}")
        key = platform.strip().upper()
        if key in _BY_NAME:
            return _BY_NAME[key]
        if key == "XPU":
            raise UserError("platform 'XPU' is not supported yet: XPU (Intel GPUs); use GPU, NPU, MPS or CPU")
        known = ", ".join([*_BY_NAME_ORDER, *DEVICE_TYPES])
        raise UserError(f"unknown platform {platform!r}; known: {known}")

    @classmethod
    def _pick(cls, platform: str | None) -> "type[Platform]":
        if platform is not None:
            return Platform.get_platform(platform)
        return Platform.get_platform() if cls is Platform else cls

    @classmethod
    def device_prefix(cls, platform: str | None = None) -> str:
        """The torch device type: ``cuda``, ``npu``, ``mps`` or ``cpu``."""
        return cls._pick(platform)._prefix

    @classmethod
    def device_backend(cls, platform: str | None = None) -> str:
        """The ``torch.distributed`` backend for the device: nccl (cuda), hccl (npu), else gloo."""
        return cls._pick(platform)._backend

    @classmethod
    def visible_device_env(cls, platform: str | None = None) -> str | None:
        """The variable that limits which devices a process sees (None: MPS and CPU have none)."""
        return cls._pick(platform)._visible_env

    @classmethod
    def visible_devices(cls, platform: str | None = None) -> list[str] | None:
        """The devices ``visible_device_env`` lists (``[]`` when set empty), None when unset."""
        env = cls.visible_device_env(platform)
        if env is None or env not in os.environ:
            return None
        return [part.strip() for part in os.environ[env].split(",") if part.strip()]

    @classmethod
    def device_count(cls, platform: str | None = None) -> int:
        """How many devices of the platform this process sees (CPU: 1; an absent accelerator: 0)."""
        return cls._pick(platform)._count()

    @classmethod
    def get_local_device(cls, idx: int | None = None, *, platform: str | None = None) -> str:
        """The device string for local device ``idx`` (``cuda:1``, ``npu:0``, ``mps``, ``cpu``).

        ``idx`` defaults to this process's local rank, wrapped onto the devices it sees, which
        is the device the runtime gives it (a Ray worker sees one GPU, index 0)."""
        target = cls._pick(platform)
        if target._prefix in ("mps", "cpu"):
            return target._prefix
        if idx is None:
            idx = max(0, Platform.get_local_rank())
            count = target._count()
            if count > 0:
                idx %= count
        if idx < 0:
            raise UserError(f"device index must be at least 0, got {idx}")
        return f"{target._prefix}:{idx}"

    # ------------------------------------------------------------ availability

    @staticmethod
    def is_gpu_available() -> bool:
        return Torch.is_gpu_available()

    @staticmethod
    def is_npu_available() -> bool:
        return Torch.is_npu_available()

    @staticmethod
    def is_mps_available() -> bool:
        mps = getattr(torch.backends, "mps", None)
        return bool(mps is not None and mps.is_available())

    @classmethod
    def _count(cls) -> int:  # pragma: no cover - every concrete platform overrides it
        raise NotImplementedError

    @classmethod
    def _rng_module(cls) -> Any:
        """The torch module holding the device generator, or None when the device is absent."""
        return None

    # ------------------------------------------------------------ RNG state

    @classmethod
    def get_device_rng_state(cls, platform: str | None = None) -> torch.Tensor | None:
        """The device generator's state; None on CPU or when the accelerator is absent."""
        module = cls._pick(platform)._rng_module()
        return None if module is None else module.get_rng_state()

    @classmethod
    def set_device_rng_state(cls, state: torch.Tensor | None, *, platform: str | None = None) -> None:
        """Restore a state from ``get_device_rng_state``; a no-op for None or an absent device."""
        module = cls._pick(platform)._rng_module()
        if state is not None and module is not None:
            module.set_rng_state(state)

    @classmethod
    def get_vllm_device_uuid(cls, device_id: int = 0, platform: str | None = None) -> str:
        raise UserError(
            "Platform.get_vllm_device_uuid is not supported yet: get_vllm_device_uuid "
            "(Twinkle has no vLLM sampler)"
        )

    # ------------------------------------------------------------ ranks (torchrun's variables)

    @staticmethod
    def get_rank() -> int:
        """``$RANK``; -1 when no launcher set it."""
        return _env_int("RANK", default=-1)

    @staticmethod
    def get_local_rank() -> int:
        """``$LOCAL_RANK``; -1 when no launcher set it."""
        return _env_int("LOCAL_RANK", default=-1)

    @staticmethod
    def get_world_size() -> int:
        return _env_int("WORLD_SIZE", default=1)

    @staticmethod
    def get_local_world_size() -> int:
        return _env_int("LOCAL_WORLD_SIZE", "LOCAL_SIZE", default=1)

    @staticmethod
    def get_nnodes() -> int:
        """``$NNODES``, else the world size over the local world size (torchrun sets no NNODES)."""
        nnodes = _env_int("NNODES", default=0)
        if nnodes > 0:
            return nnodes
        return max(1, Platform.get_world_size() // max(1, Platform.get_local_world_size()))

    @staticmethod
    def get_node_rank() -> int:
        """``$NODE_RANK``, else torchrun's ``$GROUP_RANK``, else 0."""
        return _env_int("NODE_RANK", "GROUP_RANK", default=0)

    @staticmethod
    def is_master() -> bool:
        """Rank 0, or a process no launcher started."""
        return Platform.get_rank() in (-1, 0)

    @staticmethod
    def is_local_master() -> bool:
        return Platform.get_local_rank() in (-1, 0)

    @staticmethod
    def is_last_rank() -> bool:
        return Platform.get_rank() in (-1, Platform.get_world_size() - 1)

    @staticmethod
    def get_peer_index(target_size: int, rank: int | None = None, world_size: int | None = None) -> slice:
        """The part of ``target_size`` items (or peers) that ``rank`` of ``world_size`` takes.

        Contiguous parts, the first ``target_size % world_size`` ranks one item longer; with
        fewer items than ranks, rank ``r`` takes item ``r % target_size``."""
        rank = max(0, Platform.get_rank() if rank is None else rank)
        world_size = max(1, Platform.get_world_size() if world_size is None else world_size)
        if 0 < target_size < world_size:
            first = rank % target_size
            return slice(first, first + 1)
        base, extra = divmod(target_size, world_size)
        start = rank * base + min(rank, extra)
        return slice(start, start + base + (1 if rank < extra else 0))


class GPU(Platform):
    _prefix, _backend, _visible_env = "cuda", "nccl", "CUDA_VISIBLE_DEVICES"

    @classmethod
    def _count(cls) -> int:
        return torch.cuda.device_count() if Torch.is_gpu_available() else 0

    @classmethod
    def _rng_module(cls) -> Any:
        return torch.cuda if Torch.is_gpu_available() else None


class NPU(Platform):
    _prefix, _backend, _visible_env = "npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES"

    @classmethod
    def _count(cls) -> int:
        return torch.npu.device_count() if Torch.is_npu_available() else 0

    @classmethod
    def _rng_module(cls) -> Any:
        return torch.npu if Torch.is_npu_available() else None


class MPS(Platform):
    _prefix, _backend, _visible_env = "mps", "gloo", None

    @classmethod
    def _count(cls) -> int:
        return 1 if Platform.is_mps_available() else 0

    @classmethod
    def _rng_module(cls) -> Any:
        return torch.mps if Platform.is_mps_available() else None


class CPU(Platform):
    _prefix, _backend, _visible_env = "cpu", "gloo", None

    @classmethod
    def _count(cls) -> int:
        return 1


_BY_NAME_ORDER = ("GPU", "NPU", "MPS", "CPU")
_BY_NAME: dict[str, type[Platform]] = {
    "GPU": GPU,
    "CUDA": GPU,
    "NPU": NPU,
    "MPS": MPS,
    "CPU": CPU,
}
