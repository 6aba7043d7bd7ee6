"""``vLLMSampler``: ``TorchSampler``'s contract on vLLM, for CUDA GPUs (optional extra
``twinkle[vllm]``; vLLM is imported only when one is built).

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
from twinkle.runtime.remote import remote_class  # remote_group= hook
from twinkle.sampler.prompts import new_input_feature, prompts_of
from twinkle.sampler.stops import Stops
from twinkle.template import Template, get_template
from twinkle.template.tokenizer import load_tokenizer
from twinkle.utils.errors import UserError

NEEDS = (
    "vLLMSampler needs vllm and a CUDA GPU: pip install 'twinkle[vllm]' on a GPU machine, or use TorchSampler"
)


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError:
        vllm = None
    if vllm is None or not torch.cuda.is_available():
        raise UserError(NEEDS)
    return vllm


@remote_class  # remote_group=: built on a device group's ranks (twinkle.runtime.remote)
class vLLMSampler:  # noqa: N801  (upstream's name)
    """``vLLMSampler(model_id, engine_args=None, device_mesh=None)``; ``engine_args`` reach
    ``vllm.LLM`` (``gpu_memory_utilization``, ``max_model_len``, ``max_lora_rank``, ...)."""

    def __init__(
        self, model_id: str | None = None, engine_args: dict[str, Any] | None = None, device_mesh: Any = None
    ):
        vllm = _import_vllm()
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

    def receive_merged(self, weights: dict[str, torch.Tensor]) -> int:
        raise UserError(
            "vLLMSampler: merge_and_sync=True is not supported yet: merge_and_sync; use sync_weights() (LoRA only)"
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
    ) -> list[SampleResponse]:
        from vllm import SamplingParams as VllmParams
        from vllm.inputs import TokensPrompt

        params = (
            sampling_params
            if isinstance(sampling_params, SamplingParams)
            else (SamplingParams.from_dict(sampling_params or {}))
        )
        prompts = prompts_of(inputs, self._template, self.tokenizer)
        vllm_params = VllmParams(
            n=params.num_samples,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            max_tokens=params.max_tokens,
            seed=params.seed,
            stop=params.stop_strings or None,
            stop_token_ids=params.stop_token_ids or None,
            include_stop_str_in_output=params.include_stop_str_in_output,
            logprobs=max(1, params.logprobs or 1),
        )
        request = self._request(adapter_name, adapter_path)
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p.ids) for p in prompts], vllm_params, lora_request=request
        )
        stops = Stops(self.tokenizer, set(), params)
        return [
            SampleResponse(
                sequences=[self._sequence(prompt, c, stops, params) for c in out.outputs],
                prompt_token_ids=list(prompt.ids),
            )
            for prompt, out in zip(prompts, outputs, strict=True)
        ]

    @staticmethod
    def _sequence(prompt: Any, completion: Any, stops: Stops, params: SamplingParams) -> SampledSequence:
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
