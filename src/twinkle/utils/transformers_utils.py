"""Helpers at the border of a model's outputs and the step's per-sequence values (upstream's
``twinkle.utils.transformers_utils`` names): ``align_logps_to_mask`` and
``filter_from_config_kwargs``."""

from collections.abc import Sequence
from typing import Any

import torch

from twinkle.utils.errors import UserError

# ``from_pretrained`` keywords that only steer loading; a config built from the same keywords
# would store them as if they were the model's settings
LOAD_ONLY_KEYS = frozenset(
    {
        "cache_dir",
        "device_map",
        "force_download",
        "ignore_mismatched_sizes",
        "local_files_only",
        "low_cpu_mem_usage",
        "max_memory",
        "offload_buffers",
        "offload_folder",
        "offload_state_dict",
        "output_loading_info",
        "proxies",
        "resume_download",
        "revision",
        "subfolder",
        "token",
        "trust_remote_code",
        "use_safetensors",
        "state_dict",
        "weights_only",
    }
)


def filter_from_config_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` without the keys that only steer loading (``LOAD_ONLY_KEYS``)."""
    return {key: value for key, value in kwargs.items() if key not in LOAD_ONLY_KEYS}


def align_logps_to_mask(values: Any, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """Per-sequence values as a ``(B, L)`` tensor placed at ``mask``'s True positions (0
    elsewhere): a ``(B, L)`` tensor as it is; else one entry per row, each either a number (the
    same at every masked position: a row's advantage) or the values of that row's masked
    positions only, in order (a sampler's completion log-probs). A row whose count differs from
    its masked positions is a one-line ``UserError`` (a value would land on the wrong token);
    None when ``values`` is neither a tensor nor a sequence."""
    rows, length = mask.shape
    if torch.is_tensor(values):
        if tuple(values.shape) == (rows, length):
            return values.to(mask.device, dtype)
        values = list(values) if values.dim() >= 1 else None
    if values is None or isinstance(values, str) or not isinstance(values, Sequence):
        return None
    if len(values) != rows:
        raise UserError(f"got {len(values)} rows of values for a batch of {rows} rows; give one per row")
    out = torch.zeros((rows, length), dtype=dtype, device=mask.device)
    for i, row in enumerate(values):
        where = mask[i].nonzero(as_tuple=True)[0]
        if isinstance(row, int | float) or (torch.is_tensor(row) and row.numel() == 1 and where.numel() != 1):
            out[i, where] = float(row)
            continue
        row = torch.as_tensor(row, dtype=dtype, device=mask.device).flatten()
        if row.numel() != where.numel():
            raise UserError(
                f"row {i} has {row.numel()} values but {where.numel()} labelled positions; give one value "
                "per labelled token (the sampler's log-probs of that same sequence) or one number per row"
            )
        out[i, where] = row
    return out
