"""``ClientMultiTurnRollout``: ``MultiTurnRollout`` sampling through ``twinkle_client`` from a
``twinkle server``.

The loop, the token bookkeeping and the tools are the local rollout's; only the sampling call
differs: the server's sampler takes the parameters it serves (``twinkle_client.sampler.PARAMS``)
as a dict, and its sequences carry log-probs whatever ``logprobs`` says. The template must be
local (``template=``, or the client sampler's ``set_template``): turns are rendered and joined
here, and only token ids travel."""

import dataclasses
from typing import Any

from twinkle.data_format.sampling import SamplingParams
from twinkle_agentic.rollout.multi_turn import MultiTurnRollout

SERVED = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "num_samples", "logprobs")


class ClientMultiTurnRollout(MultiTurnRollout):
    """As ``MultiTurnRollout``; ``sampler`` is a ``twinkle_client.sampler.vLLMSampler`` (or
    anything with its ``sample(rows, sampling_params: dict)``)."""

    def sample_rows(self, rows: list[dict[str, Any]], params: SamplingParams) -> list[Any]:
        values = dataclasses.asdict(params)
        return self.sampler.sample(rows, {k: values[k] for k in SERVED if values.get(k) is not None})
