"""Small collectives that are no-ops in a single process."""

import torch
import torch.distributed as dist

_PEER_LOST = ("Connection closed by peer", "Connection reset by peer")


def peer_lost(exc: BaseException) -> bool:
    """A collective that failed because another rank of the job died (gloo's transport error, or
    torch's ``DistBackendError``): that rank's death is the report, not this rank's traceback."""
    return type(exc).__name__ == "DistBackendError" or (
        isinstance(exc, RuntimeError) and any(s in str(exc) for s in _PEER_LOST)
    )


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _comm_device() -> torch.device:
    """gloo reduces CPU tensors; nccl (CUDA) and hccl (Ascend) reduce tensors on this rank's
    device, the one ``initialize`` made current."""
    kind = {"nccl": "cuda", "hccl": "npu"}.get(dist.get_backend())
    if kind is None:
        return torch.device("cpu")
    return torch.device(kind, getattr(torch, kind).current_device())


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum a few numbers over all ranks (in float64, so token counts stay exact)."""
    if not is_distributed():
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t)
    return t.tolist()


def all_reduce_max(values: list[float]) -> list[float]:
    """The largest of a few numbers over all ranks."""
    if not is_distributed():
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def barrier() -> None:
    if is_distributed():
        dist.barrier()
