"""Where adapter slots go, and where each adapter's LoRA lands among them.

``slot_config``: the slots' own ``peft.LoraConfig`` from ``MultiLoraTransformersModel``'s
``lora_config=`` (upstream's keyword; a ``LoraConfig`` or a dict of its fields) or
``target_modules=``. A slot config says where the slots go: ``target_modules``,
``exclude_modules``, ``target_parameters`` (LoRA on an MoE layer's fused experts). Its rank is
``max_r``. ``r``, ``lora_alpha``, ``lora_dropout`` and ``use_rslora`` belong to each adapter
(``add_adapter_to_model``'s config sets them for its slot), so a value other than PEFT's default
there is not used and is named in a warning; any other field set away from PEFT's default is
refused by name, as the slots could not honour it.

``adapter_layout``: the slot layers an adapter's config reaches, with its rank and scaling on
each and the module path its weights have in a PEFT file, as PEFT itself would place it on the
model alone. PEFT first rewrites some MoE configs for transformers' fused experts
(``convert_peft_config_for_transformers``: on Qwen3-MoE, DeepSeek-V3, Qwen3-Next, ``all-linear``
and the MLP names reach ``gate_up_proj`` at twice the rank, and the router's weight); the layout
starts from that rewritten config, which is also the one the adapter saves."""

import copy
import dataclasses
import math
from typing import Any

from twinkle.model.slots import Target, is_param_wrapper, slot_rank
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

logger = get_logger()

DEFAULT_TARGETS = "all-linear"  # the slots' modules when neither keyword names them
SLOT_KEYS = ("target_modules", "exclude_modules", "target_parameters")
ADAPTER_KEYS = ("r", "lora_alpha", "lora_dropout", "use_rslora")
# bookkeeping fields of every PEFT config, not settings of the LoRA
BOOKKEEPING = (
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
    "inference_mode", "runtime_config",
)  # fmt: skip


def slot_config(lora_config: Any, target_modules: Any, max_r: int) -> Any:
    """The slots' ``LoraConfig`` (rank ``max_r``); ``UserError`` naming a field it cannot honour."""
    from peft import LoraConfig

    if lora_config is None:
        return LoraConfig(
            r=max_r, lora_alpha=max_r, lora_dropout=0.0, target_modules=target_modules or DEFAULT_TARGETS
        )
    if isinstance(lora_config, dict):
        try:
            lora_config = LoraConfig(**lora_config)
        except (TypeError, ValueError) as exc:
            raise UserError(f"MultiLoraTransformersModel(lora_config={lora_config!r}): {exc}") from exc
    if not isinstance(lora_config, LoraConfig):
        raise UserError(
            f"MultiLoraTransformersModel(lora_config=...) takes a peft.LoraConfig or a dict of its fields, "
            f"got {type(lora_config).__name__}"
        )
    default = LoraConfig()
    changed = [
        f.name
        for f in dataclasses.fields(LoraConfig)
        if getattr(lora_config, f.name) != getattr(default, f.name)
    ]
    refused = [k for k in changed if k not in SLOT_KEYS + ADAPTER_KEYS + BOOKKEEPING]
    if refused:
        raise UserError(
            f"MultiLoraTransformersModel(lora_config=...) sets {', '.join(refused)}, which adapter slots do not "
            f"take; it says where the slots go ({', '.join(SLOT_KEYS)}): leave the others at PEFT's default"
        )
    unused = [k for k in changed if k in ADAPTER_KEYS]
    if unused:
        logger.warning(
            "MultiLoraTransformersModel(lora_config=...): %s not used: the slots have rank max_r=%d and each "
            "adapter's own config (add_adapter_to_model) sets its rank, scaling and dropout",
            ", ".join(f"{k}={getattr(lora_config, k)!r}" for k in unused),
            max_r,
        )
    targets = lora_config.target_modules
    if target_modules is not None and targets is not None and _listed(target_modules) != _listed(targets):
        raise UserError(
            f"MultiLoraTransformersModel(target_modules={target_modules!r}, lora_config=...) with "
            f"lora_config.target_modules={targets!r}: name the slots' modules once"
        )
    return LoraConfig(
        r=max_r,
        lora_alpha=max_r,
        lora_dropout=0.0,
        target_modules=targets if targets is not None else (target_modules or DEFAULT_TARGETS),
        exclude_modules=lora_config.exclude_modules,
        target_parameters=lora_config.target_parameters,
    )


def _listed(value: Any) -> Any:
    return sorted(value) if isinstance(value, (list, tuple, set, frozenset)) else value


def converted(config: Any, lm: Any) -> Any:
    """A copy of ``config`` as PEFT rewrites it for ``lm`` (transformers' fused MoE experts)."""
    from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers

    config = copy.deepcopy(config)
    convert_peft_config_for_transformers(config, lm, None)
    return config


def expert_targets(config: Any) -> list[str]:
    return sorted(config.target_parameters or [])


def adapter_layout(
    name: str, config: Any, layers: dict[str, Any], modules: list[str], slot: str
) -> dict[str, Target]:
    """Adapter ``name``'s ``Target`` on each slot layer (``layers``, by ``layer_key``) it reaches:
    the module keys ``modules`` (matched from its ``target_modules``) and the slot parameters its
    ``target_parameters`` name (PEFT's match: the whole key or its dotted end). ``config`` is
    the converted one. ``UserError`` for a target outside the slots or a rank above theirs."""
    from peft.utils.other import get_pattern_key

    wanted = list(config.target_parameters or [])
    params = [
        k
        for k, m in layers.items()
        if is_param_wrapper(m) and any(k == t or k.endswith("." + t) for t in wanted)
    ]
    missing = [t for t in wanted if not any(k == t or k.endswith("." + t) for k in params)]
    if missing:
        held = sorted(
            {
                k.rsplit(".", 2)[-2] + "." + k.rsplit(".", 1)[-1]
                for k, m in layers.items()
                if is_param_wrapper(m)
            }
        )
        raise UserError(
            f"adapter {name!r} targets parameters {missing}, outside the slots' ({', '.join(held) or 'none'}); "
            "give the slots them: MultiLoraTransformersModel(..., lora_config=LoraConfig(target_parameters=[...]))"
        )
    if params and config.lora_dropout:
        raise UserError(
            f"adapter {name!r}: lora_dropout={config.lora_dropout} with target_parameters; PEFT's LoRA on a "
            "parameter has no dropout: set lora_dropout=0"
        )
    layout = {}
    for key in [k for k in layers if k in set(modules) | set(params)]:
        r = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), key), config.r)
        alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), key), config.lora_alpha)
        if r > slot_rank(layers[key], slot):
            raise UserError(
                f"adapter {name!r} has rank {r} on {key}, more than the slots' {slot_rank(layers[key], slot)} there; "
                "raise max_r= or lower r"
            )
        scaling = alpha / (math.sqrt(r) if config.use_rslora else r)
        layout[key] = Target(r, scaling, saved_path(key, layers, params))
    return layout


def saved_path(key: str, layers: dict[str, Any], params: list[str]) -> str:
    """The module path of ``key``'s weights in the adapter's own PEFT file. A module's is its key.
    PEFT wraps the targeted parameters of one module in the order the module registered them,
    each wrapper around the previous one: the last is the module itself, each earlier one a
    ``.base_layer`` further in."""
    if key not in params:
        return key
    module, _, name = key.rpartition(".")
    order = list(layers[key].get_base_layer()._parameters)
    mine = [p for p in order if f"{module}.{p}" in params]
    return module + ".base_layer" * (len(mine) - 1 - mine.index(name))
