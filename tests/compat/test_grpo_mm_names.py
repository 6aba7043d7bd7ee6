"""What upstream's multimodal GRPO cookbook names and Twinkle does not build yet: the
OlympiadBench reward names import and refuse in one line when built; vLLM engine settings for
images in prompts are one line naming it."""

import pytest

from twinkle.reward.olympiad_bench import (
    OlympiadBenchAccuracyReward,
    OlympiadBenchFormatReward,
    OlympiadBenchQualityReward,
)
from twinkle.utils.errors import UserError


@pytest.mark.parametrize(
    "cls", [OlympiadBenchAccuracyReward, OlympiadBenchFormatReward, OlympiadBenchQualityReward]
)
def test_each_refuses_in_one_line(cls):
    with pytest.raises(UserError, match=f"{cls.__name__}: not supported yet: OlympiadBench rewards") as info:
        cls()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("key", "what"),
    [("limit_mm_per_prompt", "images in prompts"), ("mm_processor_kwargs", "images in prompts")],
)
def test_vllm_settings_of_what_is_not_built_are_one_line(key, what):
    from twinkle.sampler.engine_args import read_engine_args

    with pytest.raises(UserError, match=f"TorchSampler: engine_args {key} is not supported yet: {what}"):
        read_engine_args({key: {"image": 1}, "max_model_len": 64}, "TorchSampler")
