"""``VllmEngine``: ``TorchSampler``'s contract on vLLM, what ``vLLMSampler`` runs where vLLM and a
CUDA GPU are present (optional extra ``twinkle[vllm]``; vLLM is imported only when one is built).

A thin layer: prompts are rendered as ``TorchSampler`` renders them, vLLM generates, and its
outputs become the same ``SampleResponse`` records. Log-probabilities are vLLM's raw ones
(``logprobs_mode='raw_logprobs'``: the model's, before temperature and top-k/top-p), the same
semantics as ``TorchSampler``. An adapter reaches vLLM as a PEFT folder: ``adapter_path=``, or
the weights ``CheckpointEngineManager.sync_weights`` sends, written to a private temporary
folder and loaded under a new LoRA id at each sync. Merged weights (``merge_and_sync=True``)
are not supported yet."""

import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from twinkle.data_format.sampling import SampledSequence, SampleResponse, SamplingParams
from twinkle.sampler.prompts import new_input_feature, prompts_of
from twinkle.sampler.stops import Stops
from twinkle.template import Template, get_template
from twinkle.template.tokenizer import load_tokenizer
from twinkle.utils.errors import UserError


def vllm_missing() -> str | None:
    """Why vLLM cannot run here (None: it can)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (pip install 'twinkle[vllm]')"
    if not torch.cuda.is_available():
        return "vLLM needs a CUDA GPU and none is visible"
    return None


class VllmEngine:
    """``VllmEngine(model_id, engine_args=None, device_mesh=None)``; ``engine_args`` reach
    ``vllm.LLM`` (``gpu_memory_utilization``, ``max_model_len``, ``max_lora_rank``, ...)."""

    def __init__(
        self, model_id: str | None = None, engine_args: dict[str, Any] | None = None, device_mesh: Any = None
    ):
        import vllm

        from twinkle.hub import resolve_model

        self.device_mesh = device_mesh
        self.model_path = str(resolve_model(model_id))
        self.tokenizer = load_tokenizer(model_id)
        args = {"enable_lora": True, "logprobs_mode": "raw_logprobs", **(engine_args or {})}
        self.llm = vllm.LLM(model=self.model_path, **args)
        self.template: Template | None = None
        self._folder = Path(tempfile.mkdtemp(prefix="twinkle-vllm-lora-"))
        self._lora: dict[str, Any] = {}  # adapter name -> its current LoRARequest
        self._next_id = 1
        self.default_adapter: str | None = None
        self.merged_keys: set[str] = set()

    def set_template(
        self, template_cls: Any = "Template", model_id: str | None = None, **kwargs: Any
    ) -> None:
        if isinstance(template_cls, Template):
            self.template = template_cls
            return
        tokenizer = self.tokenizer if model_id is None else load_tokenizer(model_id)
        self.template = get_template(template_cls, tokenizer, **kwargs)

    def reset_prefix_cache(self) -> None:
        """Drop vLLM's prefix cache (its entries were computed with the weights before a sync)."""
        self.llm.reset_prefix_cache()

    def reset_mm_cache(self) -> None:
        """Drop vLLM's cache of processed media, where this vLLM has one."""
        if hasattr(self.llm, "reset_mm_cache"):
            self.llm.reset_mm_cache()

    def reset_encoder_cache(self) -> None:
        """Drop vLLM's cache of encoder outputs, where this vLLM has one."""
        if hasattr(self.llm, "reset_encoder_cache"):
            self.llm.reset_encoder_cache()

    def _template(self) -> Template:
        if self.template is None:
            self.template = get_template("Template", self.tokenizer)
        return self.template

    # ----------------------------------------------------------------- weights
    def receive_lora(self, adapter_name: str, config: Any, tensors: dict[str, torch.Tensor]) -> int:
        """Write the adapter as a PEFT folder and load it under a new LoRA id."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        folder = self._folder / f"{adapter_name}-{self._next_id}"
        folder.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps(config.to_dict(), default=list))
        self._lora[adapter_name] = LoRARequest(adapter_name, self._next_id, str(folder))
        self._next_id += 1
        self.default_adapter = adapter_name
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def receive_base_weights(self, weights: dict[str, torch.Tensor], merged: bool) -> int:
        raise UserError(
            "vLLMSampler: not supported yet: sync_weights(merge_and_sync=True); use sync_weights(merge_and_sync=False)"
        )

    def _request(self, adapter_name: str, adapter_path: Any) -> Any:
        from vllm.lora.request import LoRARequest

        if adapter_path is not None:
            self._next_id += 1
            return LoRARequest(f"path{self._next_id}", self._next_id, str(adapter_path))
        name = adapter_name or self.default_adapter
        if not name:
            return None
        if name not in self._lora:
            raise UserError(
                f"unknown adapter {name!r}; the sampler's adapters: {', '.join(self._lora) or 'none'}"
            )
        return self._lora[name]

    # ----------------------------------------------------------------- sampling
    def sample(
        self,
        inputs: Any,
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        adapter_name: str = "",
        adapter_path: Any = None,
        *,
        use_base_model: bool = False,
    ) -> list[SampleResponse]:
        from vllm import SamplingParams as VllmParams
        from vllm.inputs import TokensPrompt

        params = (
            sampling_params
            if isinstance(sampling_params, SamplingParams)
            else (SamplingParams.from_dict(sampling_params or {}))
        )
        scoring = params.max_tokens == 0  # vLLM generates at least one token: it is dropped
        prompts = prompts_of(inputs, self._template, scoring)
        vllm_params = VllmParams(
            n=params.num_samples,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            max_tokens=1 if scoring else params.max_tokens,
            repetition_penalty=params.repetition_penalty,
            prompt_logprobs=params.prompt_logprobs,
            seed=params.seed,
            stop=params.stop_strings or None,
            stop_token_ids=params.stop_token_ids or None,
            include_stop_str_in_output=params.include_stop_str_in_output,
            logprobs=max(1, params.logprobs or 1),
        )
        if use_base_model and (adapter_name or adapter_path is not None):
            raise UserError(
                "sample: use_base_model=True runs no adapter; drop adapter_name= and adapter_path="
            )
        request = None if use_base_model else self._request(adapter_name, adapter_path)
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p.ids) for p in prompts], vllm_params, lora_request=request
        )
        stops = Stops(self.tokenizer, set(), params)
        return [
            SampleResponse(
                sequences=[self._sequence(prompt, c, stops, params, scoring) for c in out.outputs],
                prompt_token_ids=list(prompt.ids),
                **_prompt_scores(prompt.ids, out.prompt_logprobs, params.prompt_logprobs),
            )
            for prompt, out in zip(prompts, outputs, strict=True)
        ]

    @staticmethod
    def _sequence(
        prompt: Any, completion: Any, stops: Stops, params: SamplingParams, scoring: bool
    ) -> SampledSequence:
        if scoring:
            return SampledSequence([], [], "", "length", new_input_feature(prompt, [], ""))
        tokens = list(completion.token_ids)
        keep = max(1, params.logprobs or 1)
        logprobs = []
        for token, options in zip(tokens, completion.logprobs or [], strict=False):
            entry = [(token, float(options[token].logprob))]
            others = sorted((v.rank, t, float(v.logprob)) for t, v in options.items() if t != token)
            logprobs.append(entry + [(t, lp) for _, t, lp in others][: keep - 1])
        reason = "length" if completion.finish_reason == "length" else "stop"
        return SampledSequence(
            tokens=tokens,
            logprobs=logprobs,
            decoded=completion.text,
            stop_reason=reason,
            new_input_feature=new_input_feature(prompt, tokens, completion.text),
        )


def _prompt_scores(ids: list[int], scores: Any, k: int | None) -> dict[str, Any]:
    """vLLM's prompt log-probabilities (per position, a dict token -> Logprob holding the prompt
    token and the ``k`` most likely) as ``SampleResponse``'s two lists."""
    if k is None or scores is None:
        return {}
    chosen: list[float | None] = []
    top: list[list[tuple[int, float]] | None] = []
    for token, options in zip(ids, scores, strict=True):
        if options is None:
            chosen.append(None)
            top.append(None)
            continue
        chosen.append(float(options[token].logprob) if token in options else None)
        ranked = sorted(options.items(), key=lambda item: -item[1].logprob)[:k]
        top.append([(t, float(v.logprob)) for t, v in ranked])
    return {"prompt_logprobs": chosen, "topk_prompt_logprobs": top}
