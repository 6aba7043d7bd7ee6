"""Upstream Twinkle's ``TransformersModel`` keywords, checked and mapped to ours.

Nothing is silently ignored: a value that cannot be honoured here raises ``UserError`` naming it,
except ``mixed_precision='fp16'``, which falls back to the device's default dtype with one
warning (``fp16_fallback``), as upstream scripts pass it for GPUs."""

from typing import Any

import torch

from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

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
    fsdp_config = dict(fsdp_config or {})
    # upstream's EP switch and options, read by twinkle.model.expert_parallel.resolve_options
    fsdp_config.pop("expert_parallel", None)
    # what FSDP2 does here anyway: each decoder layer frees its gathered weights after its forward
    # (the root keeps its own until backward, which needs them first: FSDP2's default for a root)
    if fsdp_config.get("reshard_after_forward") is True:
        del fsdp_config["reshard_after_forward"]
    if fsdp_config:
        raise UserError(
            f"fsdp_config keys {sorted(fsdp_config)} are not supported here: FSDP2 shards each decoder "
            "layer and the root, with the precision policy of the weights' dtype"
        )
    return ours


def resolve_precision(
    mixed_precision: str | None, grad_scaler_config: dict[str, Any] | None
) -> torch.dtype | None:
    """The weights' dtype for upstream's ``mixed_precision`` (None: leave it to ``dtype``);
    ``fp16`` falls back (``fp16_fallback``)."""
    if mixed_precision == "fp16":
        return fp16_fallback(grad_scaler_config)
    if grad_scaler_config:
        raise UserError("grad_scaler_config= is for fp16 training, which is not supported here; use bf16")
    if mixed_precision is None:
        return None
    if mixed_precision not in PRECISIONS:
        raise UserError(
            f"mixed_precision={mixed_precision!r} is not supported here; use one of {', '.join(PRECISIONS)}"
        )
    return PRECISIONS[mixed_precision]


_warned: set[str] = set()


def fp16_fallback(grad_scaler_config: dict[str, Any] | None) -> torch.dtype:
    """``mixed_precision='fp16'``: fp16 training needs a gradient scaler (loss scaling, against
    fp16's narrow range), which Twinkle does not run, so no device trains in fp16 here. The
    run's default dtype for its device stands in (bf16 on accelerators, fp32 on CPU:
    ``twinkle.model.loading.default_dtype``), with one warning per process; a
    ``grad_scaler_config`` given with it has nothing to configure and is ignored."""
    from twinkle.model.loading import default_dtype
    from twinkle.runtime import get_runtime

    device = get_runtime().device
    dtype = default_dtype(device)
    if "fp16" not in _warned:
        _warned.add("fp16")
        ignored = "; grad_scaler_config= is ignored" if grad_scaler_config else ""
        get_logger().warning(
            f"mixed_precision='fp16' needs a gradient scaler, which is not implemented here{ignored}; "
            f"training in {str(dtype).removeprefix('torch.')} on {device.type} instead"
        )
    return dtype
