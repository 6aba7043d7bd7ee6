"""vLLM settings upstream's multimodal GRPO cookbook passes: the image processor's are one line
naming them, and the limit of images per prompt is read. (Its OlympiadBench rewards:
``test_olympiad_bench_mm.py``.)"""

import pytest

from twinkle.utils.errors import UserError


def test_the_image_processor_settings_of_vllm_are_one_line():
    from twinkle.sampler.engine_args import read_engine_args

    with pytest.raises(
        UserError, match="TorchSampler: engine_args mm_processor_kwargs is not supported yet: image processor"
    ) as info:
        read_engine_args({"mm_processor_kwargs": {"max_pixels": 1024}, "max_model_len": 64}, "TorchSampler")
    assert "\n" not in str(info.value)


def test_limit_mm_per_prompt_is_read_and_a_bad_one_is_one_line():
    from twinkle.sampler.engine_args import read_engine_args

    assert read_engine_args({"limit_mm_per_prompt": {"image": 3}}, "TorchSampler").image_limit == 3
    assert read_engine_args({"limit_mm_per_prompt": {"video": 0}}, "TorchSampler").image_limit is None
    with pytest.raises(UserError, match=r"limit_mm_per_prompt=3 must be a dict like \{'image': 3\}"):
        read_engine_args({"limit_mm_per_prompt": 3}, "TorchSampler")
