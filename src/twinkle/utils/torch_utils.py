"""Small tensor helpers under upstream's names: ``to_device``, ``clone_state_dict_to_cpu``,
``pad_sequence_to_length``, ``pad_and_stack_tensors``, ``selective_log_softmax``."""

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from twinkle.utils.errors import UserError


def to_device(data: Any, device: str | torch.device | int, non_blocking: bool = False) -> Any:
    """``data`` with every tensor inside (mappings, lists and tuples, nested) moved to ``device``;
    other values as they are."""
    if torch.is_tensor(data):
        return data.to(device, non_blocking=non_blocking)
    if isinstance(data, Mapping):
        return type(data)({key: to_device(value, device, non_blocking) for key, value in data.items()})
    if isinstance(data, list | tuple):
        return type(data)(to_device(value, device, non_blocking) for value in data)
    return data


def clone_state_dict_to_cpu(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A copy whose tensors are detached CPU clones (never sharing storage with the source)."""
    return {
        key: value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value
        for key, value in state_dict.items()
    }


def pad_sequence_to_length(
    tensor: torch.Tensor, max_seq_len: int, pad_value: float = 0.0, left_pad: bool = False
) -> torch.Tensor:
    """``tensor`` padded along its last dimension to ``max_seq_len`` (a longer one as it is)."""
    missing = max_seq_len - tensor.shape[-1]
    if missing <= 0:
        return tensor
    return F.pad(tensor, (missing, 0) if left_pad else (0, missing), value=pad_value)


def pad_and_stack_tensors(
    tensors: Sequence[torch.Tensor], pad_value: float = -200, concat: bool = True
) -> torch.Tensor:
    """One tensor from several, each padded on the right of its last dimension to the longest:
    concatenated along the first dimension (``concat``; a tensor with fewer dimensions than the
    others gets leading ones first, so a ``(3,)`` joins ``(2, 4)`` as a row), or stacked. One
    tensor is returned as it is."""
    if not tensors:
        raise UserError("pad_and_stack_tensors: got no tensors")
    if len(tensors) == 1:
        return tensors[0]
    width = max(t.shape[-1] for t in tensors)
    if not concat:
        return torch.stack([pad_sequence_to_length(t, width, pad_value) for t in tensors])
    ndim = max(t.dim() for t in tensors)
    shaped = [t.reshape((1,) * (ndim - t.dim()) + tuple(t.shape)) for t in tensors]
    return torch.cat([pad_sequence_to_length(t, width, pad_value) for t in shaped])


def selective_log_softmax(
    logits: torch.Tensor, index: torch.Tensor, return_entropy: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax(logits)[..., index]`` without keeping the whole log-softmax: per row, the
    chosen logit minus the row's ``logsumexp``. Half-precision logits are computed in float32
    (a bf16 ``logsumexp`` loses the small differences that matter here) and returned in their
    dtype. ``return_entropy``: also each row's entropy, ``logsumexp - sum(p * logits)``."""
    work = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    lse = torch.logsumexp(work, dim=-1)
    logps = (work.gather(-1, index.unsqueeze(-1)).squeeze(-1) - lse).to(logits.dtype)
    if not return_entropy:
        return logps
    entropy = lse - (torch.softmax(work, dim=-1) * work).sum(-1)
    return logps, entropy.to(logits.dtype)
