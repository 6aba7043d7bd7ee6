"""Activation checkpointing, decided per micro-batch.

Recomputing each decoder layer's forward during backward frees its saved activations at the
price of about a third more compute. ``auto`` (the default) turns it on only for a micro-batch
whose estimated activations would not fit in the memory left on the device; ``on`` and ``off``
force it. The layers are wrapped once; the wrapper checks the switch at every call, so a long
batch can be checkpointed while the short ones around it run at full speed."""

import os
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

MODES = ("auto", "on", "off")
HEADROOM = 0.8  # auto switches on when the estimate exceeds this share of the free memory
logger = get_logger()


def activation_bytes(config: Any, tokens: int, dtype: torch.dtype) -> int:
    """Saved activations of a LoRA training step over ``tokens`` positions: per layer and token
    about ``12 * hidden + 5 * intermediate`` values (norm inputs, q/k/v, attention output, the
    MLP's gate, up and product, the inputs the LoRA matrices need). Measured on SmolLM2-135M
    (fp32, 3k tokens): 55 KB per token and layer; this gives 58 KB. The one-node LoRA MLP
    (``kernel/lora/mlp.py``) keeps these same four ``intermediate``-wide values on the CPU."""
    config = config.get_text_config()  # a multimodal model's sizes are its language model's
    hidden = config.hidden_size
    inter = getattr(config, "intermediate_size", 4 * hidden)
    per_token_layer = 12 * hidden + 5 * inter
    return tokens * config.num_hidden_layers * per_token_layer * torch.finfo(dtype).bits // 8


def available_bytes(device: torch.device) -> int:
    """Memory a step can still take: free CUDA memory plus what the allocator holds unused, or
    the host's ``MemAvailable``."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class LayerCheckpointing:
    """Wraps the decoder layers of ``lm`` (its ``_no_split_modules`` classes) so that each call
    runs under ``torch.utils.checkpoint`` while ``active`` is set."""

    def __init__(self, lm: Any, mode: str = "auto"):
        if mode not in MODES:
            raise UserError(f"activation checkpointing must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self.lm = lm
        self.active = False
        self.announced = False
        names = set(getattr(lm, "_no_split_modules", None) or [])
        self.layers = [m for m in lm.modules() if type(m).__name__ in names]
        for layer in self.layers:
            if "forward" not in layer.__dict__:
                layer.forward = self._wrap(layer.forward)

    def _wrap(self, forward: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            if self.active and torch.is_grad_enabled():
                return checkpoint(forward, *args, use_reentrant=False, **kwargs)
            return forward(*args, **kwargs)

        return run

    def decide(self, tokens: int, device: torch.device) -> bool:
        """Set ``active`` for a micro-batch of ``tokens`` positions; returns it."""
        if self.mode != "auto" or not self.layers:
            self.active = self.mode == "on" and bool(self.layers)
            return self.active
        free = available_bytes(device)
        # The estimate grows with the dtype's width. When even float64's would fit, the answer is
        # off without reading every parameter's dtype (a walk over all parameters a micro-batch).
        if activation_bytes(self.lm.config, tokens, torch.float64) <= HEADROOM * free:
            self.active = False
            return False
        # the widest: fp32 LoRA layers on a bf16 base running PEFT's own forward keep fp32
        # copies of their inputs
        floats = {p.dtype for p in self.lm.parameters() if p.is_floating_point()} or {torch.float32}
        dtype = max(floats, key=lambda d: torch.finfo(d).bits)
        need = activation_bytes(self.lm.config, tokens, dtype)
        self.active = need > HEADROOM * free
        if self.active and not self.announced:
            self.announced = True
            logger.info(
                f"activation checkpointing on for batches like this one: ~{need / 2**30:.1f} GiB of "
                f"activations for {tokens} tokens, {free / 2**30:.1f} GiB free "
                "(--activation-checkpointing on|off overrides)"
            )
        return self.active
