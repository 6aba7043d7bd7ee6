"""A sample request as ``twinkle.sampler.TorchSampler`` takes it, and its answer as the route
sends it back: the request's Tinker ``sampling_params`` as the sampler's ``SamplingParams``
(``sampling_params``), a prompt and its placed images as the sampler's input row
(``prompt_row``), and each sampled sequence as (tokens, log-probs, stop reason)
(``sequences_of``). ``run_sampler`` is one whole call: what the server's model
(``twinkle.server.core.ModelCore``) and the sampler group (``twinkle.server.ray_groups``) both
run."""

from typing import Any

import numpy as np

from twinkle.data_format.sampling import SamplingParams

Images = dict[str, np.ndarray] | None  # a prompt's placed images (twinkle.server.images), or none


def run_sampler(
    sampler: Any,
    name: str,
    prompt: list[int],
    params: dict[str, Any],
    n: int,
    seed: int,
    vision: Images = None,
) -> list[tuple]:
    """``n`` completions of ``prompt`` (with its images, ``vision``) by a ``TorchSampler`` under
    adapter ``name`` ('' : the sampler's default): (tokens, their log-probs at temperature 1,
    "stop"|"length")."""
    (response,) = sampler.sample(
        prompt_row(prompt, vision), sampling_params(params, n, seed), adapter_name=name
    )
    return sequences_of(response)


def prompt_row(prompt: list[int], vision: Images) -> dict[str, Any]:
    """The sampler's input row of a prompt: its tokens, and its placed images' ``pixel_values``
    and ``image_grid_thw`` when it has them (``TorchSampler`` prefills such a row with them)."""
    return {"input_ids": list(prompt), **(vision or {})}


def sampling_params(params: dict[str, Any], n: int, seed: int) -> SamplingParams:
    """The sampler's ``SamplingParams`` of a request's Tinker ``sampling_params``: the one place
    the server maps them (the sampling route checks a request by building them here). Tinker's
    names are ``SamplingParams``' own; a field left out or null takes Tinker's default, a
    ``max_tokens`` of 0 or null is 16, and ``stop=[]`` (Tinker's "no stop") is no stop string
    (the EOS tokens still stop). Values pass as the request sends them; ``SamplingParams``
    checks them (``UserError``)."""

    def given(name: str, default: Any) -> Any:
        value = params.get(name)
        return default if value is None else value

    return SamplingParams(
        max_tokens=params.get("max_tokens") or 16,
        temperature=given("temperature", 1.0),
        top_p=given("top_p", 1.0),
        top_k=given("top_k", -1),
        num_samples=n,
        seed=seed,
        stop=params.get("stop") or None,
    )


def sequences_of(response: Any) -> list[tuple]:
    """(tokens, their log-probs at temperature 1, "stop"|"length") of each sampled sequence."""
    return [
        (list(seq.tokens), [float(entry[0][1]) for entry in seq.logprobs], seq.stop_reason)
        for seq in response.sequences
    ]
