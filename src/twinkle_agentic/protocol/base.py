"""``API``: a model service that answers a trajectory (its messages and tools) with one assistant
message per requested sample."""

from collections.abc import Mapping
from typing import Any

from twinkle.data_format import Message, SamplingParams


class API:
    """``api(trajectory, sampling_params)``: one ``Message`` when ``num_samples`` is 1, else a
    list of ``num_samples`` messages."""

    def __call__(
        self, trajectory: Mapping[str, Any], sampling_params: SamplingParams, **request: Any
    ) -> Message | list[Message]:
        raise NotImplementedError(
            f"{type(self).__name__} must implement __call__(trajectory, sampling_params)"
        )
