"""Upstream's ``'default'`` optimizer (``set_optimizer('default', lr=...)``, Megatron's
``OptimizerConfig`` keywords) as ``torch.optim.AdamW``: Megatron's default optimizer is Adam with
decoupled weight decay, which is AdamW. Its keywords map onto AdamW's; ``clip_grad`` becomes the
adapter's gradient-clipping norm, as Megatron's optimizer clips at its step."""

from typing import Any

from twinkle.utils.errors import UserError

NAMES = ("default", "MegatronOptimizer")
# Megatron options that describe what the step here does anyway: the LoRA weights train in fp32
# (Megatron's bf16 keeps fp32 main weights for the same reason), and FSDP2 shards the optimizer's
# state with the weights it steps (Megatron's distributed optimizer).
_SAME_HERE = ("bf16", "use_distributed_optimizer")
# Megatron options with nothing to switch on here: refused when turned on
_OFF_ONLY = ("overlap_param_gather", "log_num_zeros_in_grad", "fp16")


def default_optimizer_args(kwargs: dict[str, Any]) -> tuple[dict[str, Any], float | None]:
    """``(AdamW's keyword arguments, clip_grad or None)`` for upstream's ``'default'`` keywords."""
    out = dict(kwargs)
    for name in _SAME_HERE:
        out.pop(name, None)
    for name in _OFF_ONLY:
        if out.pop(name, False):
            raise UserError(f"set_optimizer('default'): {name}=True is not supported here; drop it")
    if out.pop("min_lr", 0.0):
        raise UserError(
            "set_optimizer('default'): min_lr belongs to the schedule here: set_lr_scheduler('default', min_lr=...)"
        )
    clip_grad = out.pop("clip_grad", None)
    betas = (out.pop("adam_beta1", 0.9), out.pop("adam_beta2", 0.999))
    if "betas" in out:
        raise UserError("set_optimizer('default'): give adam_beta1/adam_beta2, not betas")
    out["betas"] = betas
    out["eps"] = out.pop("adam_eps", out.pop("eps", 1e-8))
    out.setdefault("weight_decay", 0.01)
    return out, clip_grad
