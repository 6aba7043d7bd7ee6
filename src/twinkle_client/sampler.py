"""``Sampler`` over a ``twinkle server``: completions of token prompts from a saved adapter (a
``tinker://.../sampler_weights/...`` path) or from the base model, and prompt log-probs."""

from typing import Any

from twinkle_client.connection import Connection, current_client


class Sampler:
    def __init__(self, model_path: str | None = None, client: Connection | None = None):
        self.client = current_client(client)
        kwargs = {"model_path": model_path} if model_path else {"base_model": self.client.base_model}
        self.sampling = self.client.service.create_sampling_client(**kwargs)
        if hasattr(self.sampling, "result"):
            self.sampling = self.sampling.result()

    def sample(
        self,
        prompt_ids: list[int],
        max_tokens: int = 16,
        temperature: float = 1.0,
        num_samples: int = 1,
        seed: int = 0,
        **kw: Any,
    ) -> list[dict[str, Any]]:
        """``num_samples`` completions: ``{"tokens", "logprobs", "stop_reason"}`` each."""
        from tinker import types

        params = types.SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, **kw)
        prompt = types.ModelInput.from_ints(list(prompt_ids))
        out = self.sampling.sample(prompt, num_samples=num_samples, sampling_params=params).result()
        return [
            {"tokens": list(s.tokens), "logprobs": list(s.logprobs), "stop_reason": s.stop_reason}
            for s in out.sequences
        ]

    def compute_logprobs(self, ids: list[int]) -> list[float | None]:
        from tinker import types

        return self.sampling.compute_logprobs(types.ModelInput.from_ints(list(ids))).result()
