"""LoRA on a mixture-of-experts model's experts.

Transformers keeps each MoE layer's experts as fused 3-D parameters (``mlp.experts.gate_up_proj``
``(experts, 2 * intermediate, hidden)``, ``mlp.experts.down_proj``; gpt-oss stores them
transposed, ``(experts, in, out)``, and PEFT follows the experts' ``is_transposed``), not as
``nn.Linear`` layers, so ``target_modules`` never reaches them. PEFT's ``LoraConfig(target_parameters=[...])`` does:
each named parameter gets a rank-r update per expert (PEFT's ``ParamWrapper``), saved in PEFT's
own adapter format, so the adapter loads with ``PeftModel.from_pretrained`` on the Hugging Face
class. ``check_target_parameters`` turns a name the model does not have (a dense model's) into
one line before PEFT wraps anything."""

from typing import Any

from twinkle.utils.errors import UserError

EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # Qwen, DeepSeek, gpt-oss


def check_target_parameters(model: Any, config: Any) -> None:
    """Each of ``config.target_parameters`` names a parameter of ``model`` (PEFT's match: the
    whole name or its dotted end); else one line naming what the model holds."""
    targets = list(getattr(config, "target_parameters", None) or [])
    if not targets:
        return
    names = [name for name, _ in model.named_parameters()]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if not missing:
        return
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    has_experts = any(n.endswith("." + p) for n in names for p in EXPERT_PARAMETERS)
    hint = (
        f"its expert weights are {', '.join(EXPERT_PARAMETERS)}"
        if has_experts
        else "LoRA on experts needs a mixture-of-experts model with fused expert weights (Qwen3-MoE, DeepSeek-V3, "
        "Qwen3.5-MoE, Qwen2-MoE, gpt-oss); use target_modules for a dense model"
    )
    raise UserError(f"target_parameters {missing}: the model ({model_type}) has no such parameter; {hint}")
