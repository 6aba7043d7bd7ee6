"""Gradient helpers for the optimizer step and for checkpoints of an open accumulation window."""

import math

import torch


def clip_gradients(params: list[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> float:
    """Clip to ``max_norm`` (the global ``norm_type`` norm of whole gradients, or of the shards'
    on every rank); return the norm before."""
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    limit = max_norm if max_norm > 0 else math.inf
    if any(hasattr(p.grad, "full_tensor") for p in grads):  # shards (FSDP2): the norm over all ranks
        total = torch.nn.utils.get_total_norm([p.grad for p in grads], norm_type).full_tensor()
        torch.nn.utils.clip_grads_with_norm_(grads, limit, total)
        return float(total)
    return float(torch.nn.utils.clip_grad_norm_(grads, limit, norm_type=norm_type))


def local_grad(param: torch.nn.Parameter) -> torch.Tensor:
    """This rank's part of ``param.grad`` (the whole gradient when not sharded), on the CPU."""
    grad = param.grad
    grad = grad.to_local() if hasattr(grad, "to_local") else grad
    return grad.detach().cpu().clone()


def restore_grad(param: torch.nn.Parameter, local: torch.Tensor) -> None:
    """Inverse of ``local_grad`` on the same mesh."""
    local = local.to(param.device if not hasattr(param, "to_local") else param.to_local().device)
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import DTensor

        param.grad = DTensor.from_local(
            local,
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    else:
        param.grad = local
