"""Upstream Twinkle's ``TransformersModel`` keywords, checked and mapped to ours.

Nothing is silently ignored: a value that cannot be honoured here raises ``UserError`` naming it."""

from typing import Any

import torch

from twinkle.utils.errors import UserError

# upstream's strategy names -> ours. Both upstream FSDP strategies are FSDP2 here; "ddp" is
# replication (FSDP2's HSDP with shards of one rank: DDP's all-reduce of the gradients).
STRATEGIES = {"native_fsdp": "fsdp", "accelerate": "fsdp", "fsdp": "fsdp", "fsdp2": "fsdp", "ddp": "ddp"}
PRECISIONS = {"no": torch.float32, "bf16": torch.bfloat16}
# DDP options that describe what replication here does anyway
DDP_KEYS_HONOURED = ("find_unused_parameters",)


def resolve_strategy(
    strategy: str | None, ddp_config: dict[str, Any] | None, fsdp_config: dict[str, Any] | None
) -> str:
    if strategy is None:
        strategy = "ddp" if ddp_config else "fsdp"
    if strategy not in STRATEGIES:
        raise UserError(f"strategy={strategy!r} is not one of {', '.join(STRATEGIES)}")
    ours = STRATEGIES[strategy]
    if ddp_config and ours != "ddp":
        raise UserError(f"ddp_config= goes with strategy='ddp', not {strategy!r}")
    if fsdp_config and ours != "fsdp":
        raise UserError(f"fsdp_config= goes with an FSDP strategy, not {strategy!r}")
    unknown = sorted(set(ddp_config or {}) - set(DDP_KEYS_HONOURED))
    if unknown:
        raise UserError(
            f"ddp_config keys {unknown} are not supported here (replication is FSDP2's, not torch's DDP "
            f"wrapper); supported: {', '.join(DDP_KEYS_HONOURED)}"
        )
    if fsdp_config:
        raise UserError(
            f"fsdp_config keys {sorted(fsdp_config)} are not supported here: FSDP2 shards each decoder "
            "layer and the root, with the precision policy of the weights' dtype"
        )
    return ours


def resolve_precision(
    mixed_precision: str | None, grad_scaler_config: dict[str, Any] | None
) -> torch.dtype | None:
    """The weights' dtype for upstream's ``mixed_precision`` (None: leave it to ``dtype``)."""
    if grad_scaler_config:
        raise UserError("grad_scaler_config= is for fp16 training, which is not supported here; use bf16")
    if mixed_precision is None:
        return None
    if mixed_precision not in PRECISIONS:
        raise UserError(
            f"mixed_precision={mixed_precision!r} is not supported here; use one of {', '.join(PRECISIONS)}"
        )
    return PRECISIONS[mixed_precision]
