"""Upstream's OlympiadBench reward names import (its multimodal GRPO cookbook imports them at the
top) and refuse in one line when built."""

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
