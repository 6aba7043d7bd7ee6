"""The post-training groups of ``Args``: sampling (made from ``SamplingParams``' own fields),
RL and distillation, checkpoint sync, and the sampler engine's settings."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from twinkle.data_format.sampling import SamplingParams
from twinkle.utils.errors import UserError

from .declare import AT_LEAST_1, POSITIVE, opt

# ``SamplingParams`` fields upstream's CLI has that declare no flag there: (help, rule).
_MORE_SAMPLING_FLAGS = {"num_samples": ("sequences sampled per prompt", "an integer >= 1")}


def _sampling_flag(f: dataclasses.Field) -> tuple[str, Any, Any]:
    """A ``SamplingParams`` field as a flag: its default, and its values checked by building a
    ``SamplingParams`` with it, so the command line accepts exactly what the sampler does."""

    def valid(value: Any) -> bool:
        try:
            SamplingParams(**{f.name: value})
        except UserError:
            return False
        return True

    meta = f.metadata
    if "flag_help" not in meta:
        help_text, rule = _MORE_SAMPLING_FLAGS[f.name]
        meta = {"flag_help": help_text, "flag_rule": rule, "flag_aliases": ()}
    option = opt(f.default, meta["flag_help"], check=(valid, meta["flag_rule"]), aliases=meta["flag_aliases"])
    return f.name, f.type, option


# The sampling flags: the fields of ``SamplingParams`` that declare a flag (``_flag`` there), so a
# new sampling option reaches the command line from its one definition.
SamplingArgs = dataclasses.make_dataclass(
    "SamplingArgs",
    [
        _sampling_flag(f)
        for f in dataclasses.fields(SamplingParams)
        if "flag_help" in f.metadata or f.name in _MORE_SAMPLING_FLAGS
    ],
)
SamplingArgs.__module__ = __name__


@dataclass
class RLArgs:
    num_generations: int = opt(
        8, "completions sampled per prompt (the group GRPO compares)", check=AT_LEAST_1
    )
    advantage_scale: str = opt(
        "group",
        "GRPO advantages divided by the group's std, the batch's, or none",
        choices=("group", "batch", "none"),
    )
    advantage_type: str = opt("GRPOAdvantage", "the advantage a script builds (twinkle.advantage)")
    reward_fns: str | None = opt(None, "comma-separated reward names a script builds (twinkle.reward)")
    student_model_id: str | None = opt(None, "GKD: the student model's path or id")
    teacher_model_id: str | None = opt(None, "GKD: the teacher model's path or id")
    gkd_beta: float = opt(
        0.5,
        "GKD: the generalized JSD's mix of student and teacher",
        check=(lambda v: 0 <= v <= 1, "in [0, 1]"),
    )
    gkd_temperature: float = opt(1.0, "GKD: the distributions' temperature", check=POSITIVE)
    gkd_topk: int = opt(64, "GKD: the teacher's top-k log-probabilities per token", check=AT_LEAST_1)
    router_replay_mode: str = opt(
        "disabled", "MoE routing replay: disabled, R2 or R3", choices=("disabled", "R2", "R3")
    )


@dataclass
class CheckpointArgs:
    save_optimizer: bool = opt(True, "model.save(save_optimizer=): keep the optimizer state to resume from")
    merge_and_sync: bool = opt(
        True,
        "CheckpointEngineManager.sync_weights(merge_and_sync=): merge LoRA into the weights the sampler gets",
    )
    lora_sync_dir: str | None = opt(
        None, "where a script saves LoRA snapshots for a sampler to load (model.save(output_dir=))"
    )


@dataclass
class SamplerArgs:
    sampler_type: str = opt("vLLMSampler", "the sampler class a script builds (twinkle.sampler)")
    gpu_memory_utilization: float = opt(
        0.8, "vLLM: share of GPU memory the engine may take", check=(lambda v: 0 < v <= 1, "in (0, 1]")
    )
    max_model_len: int | None = opt(None, "vLLM: the longest prompt + completion", check=AT_LEAST_1)
    tensor_parallel_size: int | None = opt(None, "vLLM: GPUs one engine spans", check=AT_LEAST_1)
    enable_lora: bool = opt(False, "vLLM: serve LoRA adapters")
    max_lora_rank: int = opt(32, "vLLM: the largest LoRA rank served", check=AT_LEAST_1)
    enforce_eager: bool = opt(False, "vLLM: no CUDA graphs")
