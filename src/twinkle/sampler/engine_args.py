"""``engine_args``: vLLM's engine settings, as a script written for ``vLLMSampler`` passes them,
read by a sampler that runs in plain PyTorch.

Three kinds of key:

- honoured: ``max_model_len`` (prompt plus completion never exceed it, as vLLM caps them),
  ``seed`` (the draws of calls without ``SamplingParams.seed`` follow from it, as a vLLM engine's
  do), ``dtype`` (the weights' dtype, as ``--dtype``), ``enable_return_routed_experts`` (each
  sequence's ``routed_experts``, the experts every token ran through: ``twinkle.model.router_replay``),
  ``enable_prefix_caching`` (default True: finished rows' keys and values are kept for a later
  prompt that continues them, ``twinkle.sampler.turn_cache``), ``limit_mm_per_prompt``
  (``{'image': n}``: a prompt with more images is refused, as vLLM refuses it);
- vLLM's memory, batching, LoRA-slot and parallelism settings (``NO_EFFECT``): a PyTorch sampler
  allocates per call and holds any number of adapters of any rank, so they have nothing to
  set; they are accepted and named in one warning. A parallel size above 1 is refused, since
  only vLLM on GPUs splits a model that way;
- vLLM's settings of what is not built here (``NOT_YET``: the image processor's settings, which
  the template's processor holds): one line naming it;
- anything else: one error line listing the keys this sampler knows."""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

HONOURED = (
    "max_model_len",
    "seed",
    "dtype",
    "enable_return_routed_experts",
    "enable_prefix_caching",
    "limit_mm_per_prompt",
)
PARALLEL = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
NO_EFFECT = (
    "gpu_memory_utilization",
    "enable_lora",
    "max_loras",
    "max_lora_rank",
    "max_cpu_loras",
    "enable_tower_connector_lora",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_chunked_prefill",
    "enable_sleep_mode",
    "enforce_eager",
    "swap_space",
    "cpu_offload_gb",
    "kv_cache_dtype",
    "block_size",
    "disable_custom_all_reduce",
    "trust_remote_code",
    "load_format",
    "logprobs_mode",
    "max_logprobs",  # vLLM's cap on logprobs per token; this sampler returns as many as asked
    *PARALLEL,
)

NOT_YET = {
    "mm_processor_kwargs": "image processor settings per sampler (the template encodes the images "
    "with the processor saved in the model's folder)",
}


@dataclass
class EngineArgs:
    """The honoured keys' values (None: not given)."""

    max_model_len: int | None = None
    seed: int | None = None
    dtype: str | None = None
    return_routed_experts: bool = False
    prefix_caching: bool = True
    image_limit: int | None = None  # images a prompt may hold (None: any number)


def read_engine_args(engine_args: Mapping[str, Any] | None, who: str) -> EngineArgs:
    """Check ``engine_args`` (see the module docstring); warn once naming the keys without
    effect; return the honoured ones."""
    if engine_args is None:
        return EngineArgs()
    if not isinstance(engine_args, Mapping):
        raise UserError(f"{who}(engine_args=...) takes a dict, got {type(engine_args).__name__}")
    planned = [key for key in engine_args if key in NOT_YET]
    if planned:
        raise UserError(f"{who}: engine_args {planned[0]} is not supported yet: {NOT_YET[planned[0]]}")
    unknown = sorted(set(engine_args) - set(HONOURED) - set(NO_EFFECT))
    if unknown:
        raise UserError(
            f"{who}: unknown engine_args {', '.join(unknown)}; known: {', '.join(sorted((*HONOURED, *NO_EFFECT)))}"
        )
    for key in PARALLEL:
        if engine_args.get(key, 1) not in (1, None):
            raise UserError(
                f"{who}: engine_args {key}={engine_args[key]} needs vLLM on that many GPUs; "
                f"this sampler runs the whole model in one process (leave {key} at 1)"
            )
    _check_int(engine_args, "max_model_len", who, minimum=1)
    _check_int(engine_args, "seed", who, minimum=None)
    ignored = [key for key in engine_args if key in NO_EFFECT]
    if ignored:
        get_logger().warning(
            f"{who}: engine_args {', '.join(ignored)} are vLLM engine settings with nothing to set "
            "in a PyTorch sampler; ignored"
        )
    dtype = engine_args.get("dtype")
    if dtype is not None and not isinstance(dtype, str):
        dtype = str(dtype).removeprefix("torch.")
    routes = engine_args.get("enable_return_routed_experts", False)
    if not isinstance(routes, bool):
        raise UserError(f"{who}: engine_args enable_return_routed_experts={routes!r} must be True or False")
    caching = engine_args.get("enable_prefix_caching", True)
    if not isinstance(caching, bool):
        raise UserError(f"{who}: engine_args enable_prefix_caching={caching!r} must be True or False")
    return EngineArgs(
        engine_args.get("max_model_len"),
        engine_args.get("seed"),
        dtype,
        routes,
        caching,
        _image_limit(engine_args.get("limit_mm_per_prompt"), who),
    )


def _image_limit(value: Any, who: str) -> int | None:
    """``limit_mm_per_prompt``'s images per prompt: ``{'image': n}`` (other media: no prompt
    here holds them, so their limits have nothing to check)."""
    if value is None:
        return None
    limit = value.get("image") if isinstance(value, Mapping) else None
    if not isinstance(value, Mapping) or (
        limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0)
    ):
        raise UserError(
            f"{who}: engine_args limit_mm_per_prompt={value!r} must be a dict like {{'image': 3}}"
        )
    return limit


def _check_int(engine_args: Mapping[str, Any], key: str, who: str, minimum: int | None) -> None:
    value = engine_args.get(key)
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or (minimum is not None and value < minimum):
        rule = "an integer" if minimum is None else f"an integer >= {minimum}"
        raise UserError(f"{who}: engine_args {key}={value!r} must be {rule}")
