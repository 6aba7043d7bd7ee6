"""Samplers over a ``twinkle server``: ``Sampler`` (token prompts in, completions out) and
upstream's ``vLLMSampler`` (rows or trajectories in, each sequence with its log-probs and the
encoded row of prompt and completion, ``new_input_feature``, ready to train on). Both are served
by the server's sampler, on a saved adapter (``adapter_uri``/``model_path``, a ``twinkle://`` or
``tinker://`` path) or the base model.

A prompt with images (a row a vision-language template encoded, or a trajectory with
``Message.images``) goes as a Tinker ``ModelInput`` with each image an ``ImageChunk`` in place
of its placeholder tokens (``twinkle_client.image_prompts``), as the Tinker SDK sends one."""

from dataclasses import dataclass, field
from typing import Any

from twinkle.server.common import local_model_id, serves
from twinkle_client.connection import Connection, current_client
from twinkle_client.image_prompts import prompt_input, served_template, trajectory_input
from twinkle_client.tinker_patch import as_tinker_path

PARAMS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "num_samples", "logprobs")


class Sampler:
    """A sampler on saved weights (``model_path``) or the served base model. A prompt is token
    ids, an encoded row (``input_ids``, with its processed images as its family writes them:
    ``pixel_values`` and ``image_grid_thw`` for Qwen-VL, ``pixel_values`` for Gemma 3, and
    ``image_position_ids`` beside them for Gemma 4; placed by the served model's
    vision-language template) or a Tinker ``ModelInput``."""

    def __init__(self, model_path: str | None = None, client: Connection | None = None):
        self.client = current_client(client)
        self.template: Any = None  # the served model's vision-language template, read when needed
        kwargs = (
            {"model_path": as_tinker_path(model_path)}
            if model_path
            else {"base_model": self.client.base_model}
        )
        self.sampling = self.client.service.create_sampling_client(**kwargs)
        if hasattr(self.sampling, "result"):  # the SDK answers with a future of it
            self.sampling = self.sampling.result()

    def sample(
        self,
        prompt_ids: Any,
        max_tokens: int = 16,
        temperature: float = 1.0,
        num_samples: int = 1,
        seed: int | None = None,
        top_p: float = 1.0,
        top_k: int = -1,
        stop: Any = None,
    ) -> list[dict[str, Any]]:
        """``num_samples`` completions: ``{"tokens", "logprobs", "stop_reason"}`` each."""
        from tinker import types

        params = types.SamplingParams(
            max_tokens=max_tokens, temperature=temperature, seed=seed, top_p=top_p, top_k=top_k, stop=stop
        )
        prompt = self.model_input(prompt_ids)
        out = self.sampling.sample(prompt, num_samples=num_samples, sampling_params=params).result()
        return [
            {"tokens": list(s.tokens), "logprobs": list(s.logprobs), "stop_reason": s.stop_reason}
            for s in out.sequences
        ]

    def compute_logprobs(self, ids: Any) -> list[float | None]:
        """Each prompt token's log-prob (None for the first); ``ids`` as ``sample``'s prompt."""
        return self.sampling.compute_logprobs(self.model_input(ids)).result()

    def model_input(self, prompt: Any, where: str = "prompt") -> Any:
        return prompt_input(prompt, self.vision_template, where)[0]

    def vision_template(self) -> Any:
        if self.template is None:
            self.template = served_template(self.client.base_model)
        if self.template is None:
            raise ValueError(
                f"the prompt has images, but the served model {self.client.base_model} reads text only"
            )
        return self.template


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[list[tuple[int, float]]]  # upstream's shape: [[(token, log-prob)]] per token
    stop_reason: str
    decoded: str | None = None
    new_input_feature: dict[str, Any] = field(default_factory=dict)


@dataclass
class SampleResponse:
    sequences: list[SampledSequence]


class vLLMSampler:  # noqa: N801 (upstream's name)
    """Upstream's client sampler. ``model_id`` None: the served model (another is refused)."""

    def __init__(self, model_id: str | None = None, client: Connection | None = None):
        self.client = current_client(client)
        served = self.client.base_model
        if model_id is not None and not serves(served, model_id):
            raise ValueError(f"the server serves {served!r}, not {model_id!r}")
        self.template: Any = None
        self._samplers: dict[str | None, Sampler] = {}

    def set_template(self, template_cls: str, **kwargs: Any) -> None:
        """The template (a ``twinkle.template`` name or class, built with ``kwargs``) that encodes
        trajectory prompts here."""
        from twinkle.template.registry import get_template

        kwargs.setdefault("model_id", local_model_id(self.client.base_model))
        self.template = get_template(template_cls, **kwargs)

    def _prompt(self, row: Any, sampler: Sampler, where: str) -> tuple[Any, list[int], dict[str, Any]]:
        """``(ModelInput, input_ids, images)`` of an input row or trajectory (``image_prompts``)."""
        if isinstance(row, dict) and "input_ids" in row:
            if self.template is not None and hasattr(self.template, "image_token_id"):
                sampler.template = self.template  # rows this template encoded: placed by it
            return prompt_input(row, sampler.vision_template, where)
        if self.template is None:
            raise ValueError("sample: trajectories need set_template(...) first; or pass rows with input_ids")
        return trajectory_input(row, self.template, where)

    def sample(
        self, inputs: Any, sampling_params: Any = None, adapter_uri: str | None = None
    ) -> list[SampleResponse]:
        """One response per input row, each with ``num_samples`` sequences. Each row is its own
        request: with ``seed`` given, row ``i`` is seeded ``seed + i``, so rows with equal prompts
        (a GRPO group) draw different samples, as a local sampler's rows do; without, the server
        draws unseeded."""
        params = dict(sampling_params or {})
        if hasattr(sampling_params, "__dataclass_fields__"):
            params = {k: getattr(sampling_params, k) for k in sampling_params.__dataclass_fields__}
        unknown = sorted(k for k, v in params.items() if k not in PARAMS and v is not None)
        if unknown:
            raise ValueError(
                f"sampling_params {unknown} are not supported over twinkle server; use {', '.join(PARAMS)}"
            )
        params.pop("logprobs", None)  # every sequence carries its log-probs
        if adapter_uri not in self._samplers:
            self._samplers[adapter_uri] = Sampler(adapter_uri, client=self.client)
        sampler = self._samplers[adapter_uri]
        rows = inputs if isinstance(inputs, list) else [inputs]
        out = []
        for i, row in enumerate(rows):
            model_input, prompt, images = self._prompt(row, sampler, f"row {i}")
            given = {k: v for k, v in params.items() if v is not None}
            if "seed" in given:  # each row is a request of its own: equal prompts must not draw alike
                given["seed"] = int(given["seed"]) + i
            sequences = []
            for s in sampler.sample(model_input, **given):
                tokens = s["tokens"]
                feature = {"input_ids": prompt + tokens, "labels": [-100] * len(prompt) + tokens, **images}
                if isinstance(row, dict) and "messages" in row:
                    feature["messages"] = row["messages"]
                decoded = self.template.decode(tokens) if self.template is not None else None
                pairs = [[(t, float(lp))] for t, lp in zip(tokens, s["logprobs"], strict=True)]
                sequences.append(SampledSequence(tokens, pairs, s["stop_reason"], decoded, feature))
            out.append(SampleResponse(sequences))
        return out
