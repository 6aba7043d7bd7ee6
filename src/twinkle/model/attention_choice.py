"""``attn_implementation=``, as upstream scripts pass it to a model: honoured where the device
and the installed packages support it, else the fallback with one warning per process."""

import importlib.util

import torch

from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

FLASH = ("flash_attention_2", "flash_attention_3")
KNOWN = (*FLASH, "sdpa", "eager", "flex_attention")
FALLBACK = "sdpa"
_warned: set[str] = set()


def resolve_attn_implementation(
    requested: str | None, device: torch.device, dtype: torch.dtype
) -> str | None:
    """What to load the model with: ``requested`` when it can run here; a flash-attention kernel
    needs a CUDA device, its package (``flash_attn``, ``flash_attn_interface`` for 3) and 16-bit
    weights, else ``FALLBACK``. None leaves the choice to transformers."""
    if requested is None:
        return None
    if requested not in KNOWN:
        raise UserError(f"attn_implementation={requested!r} is not one of {', '.join(KNOWN)}")
    if requested not in FLASH:
        return requested
    package = "flash_attn" if requested == "flash_attention_2" else "flash_attn_interface"
    missing = []
    if device.type != "cuda":
        missing.append(f"a CUDA device (this run is on {device.type})")
    if importlib.util.find_spec(package) is None:
        missing.append(f"the {package} package")
    if dtype not in (torch.bfloat16, torch.float16):
        missing.append(f"bf16/fp16 weights (these are {str(dtype).removeprefix('torch.')})")
    if not missing:
        return requested
    if requested not in _warned:
        _warned.add(requested)
        get_logger().warning(
            f"attn_implementation={requested!r} needs {', '.join(missing)}; using {FALLBACK!r} instead"
        )
    return FALLBACK
