"""GRPO and RLOO advantages on hand-computed values."""

import math

import pytest
import torch

from twinkle.advantage import GRPOAdvantage, RLOOAdvantage
from twinkle.utils.errors import UserError

REWARDS = [0, 1, 0, 1, 1, 0, 0, 0]


def test_grpo_without_scaling_subtracts_each_groups_mean():
    got = GRPOAdvantage()(REWARDS, num_generations=4, scale="none")
    assert got.dtype == torch.float32
    assert got.tolist() == [-0.5, 0.5, -0.5, 0.5, 0.75, -0.25, -0.25, -0.25]


def test_grpo_group_scale_divides_by_the_groups_unbiased_std():
    got = GRPOAdvantage()(REWARDS, num_generations=4, scale="group")
    std_1 = math.sqrt(4 * 0.25 / 3)  # (0,1,0,1): squared deviations 0.25 each, n - 1 = 3
    std_2 = math.sqrt((0.75**2 + 3 * 0.25**2) / 3)
    want = [-0.5 / std_1, 0.5 / std_1] * 2 + [0.75 / std_2] + [-0.25 / std_2] * 3
    # float32 output of a float64 computation: within one float32 rounding of the exact value
    assert got.tolist() == pytest.approx(want, rel=1e-6)


def test_grpo_batch_scale_divides_by_the_std_of_all_rewards():
    got = GRPOAdvantage()(REWARDS, num_generations=4, scale="batch")
    std = torch.tensor(REWARDS, dtype=torch.float64).std().item()
    want = [a / std for a in [-0.5, 0.5, -0.5, 0.5, 0.75, -0.25, -0.25, -0.25]]
    assert got.tolist() == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_an_all_equal_group_gives_zeros_not_nan(scale):
    got = GRPOAdvantage()([1.0] * 4 + [0.0, 1.0, 1.0, 1.0], num_generations=4, scale=scale)
    assert torch.isfinite(got).all()
    assert got[:4].tolist() == [0.0] * 4
    assert GRPOAdvantage()([0.5] * 4, num_generations=4, scale=scale).tolist() == [0.0] * 4


def test_one_generation_per_prompt_uses_the_batch_as_baseline():
    rewards = [0.0, 1.0, 2.0]
    assert GRPOAdvantage()(rewards, num_generations=1).tolist() == rewards  # no group: unchanged
    assert GRPOAdvantage()(rewards, num_generations=1, scale="none").tolist() == [-1.0, 0.0, 1.0]
    batch = GRPOAdvantage()(rewards, num_generations=1, scale="batch").tolist()
    assert batch == pytest.approx([-1.0, 0.0, 1.0], rel=1e-6)  # the unbiased std of 0, 1, 2 is 1


def test_several_rewards_per_completion_are_summed():
    got = GRPOAdvantage()(
        torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 1.0]]), num_generations=2, scale="none"
    )
    assert got.tolist() == [0.5, -0.5, 0.5, -0.5]


def test_rloo_subtracts_the_mean_of_the_other_completions():
    got = RLOOAdvantage()(REWARDS, num_generations=4, scale="none")
    want = [-2 / 3, 2 / 3, -2 / 3, 2 / 3, 1.0, -1 / 3, -1 / 3, -1 / 3]
    assert got.tolist() == pytest.approx(want, rel=1e-6)
    scaled = RLOOAdvantage()(REWARDS, num_generations=4)  # default 'group', as upstream
    stds = torch.tensor(REWARDS, dtype=torch.float64).view(2, 4).std(dim=-1).repeat_interleave(4)
    assert scaled.tolist() == pytest.approx(
        (torch.tensor(want, dtype=torch.float64) / stds).tolist(), rel=1e-6
    )


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (
            lambda: GRPOAdvantage()([1, 0, 1], num_generations=2),
            "3 rewards do not split into groups of num_generations=2",
        ),
        (lambda: GRPOAdvantage()([1, 0], num_generations=0), "num_generations must be a positive integer"),
        (
            lambda: GRPOAdvantage()([1, 0], num_generations=2, scale="std"),
            "scale='std' is not one of group, batch, none",
        ),
        (lambda: GRPOAdvantage()([1, float("nan")], num_generations=2), "reward 1 is nan"),
        (lambda: RLOOAdvantage()([1, 0], num_generations=1), "needs num_generations >= 2"),
    ],
)
def test_bad_input_is_one_line(call, needle):
    with pytest.raises(UserError) as err:
        call()
    assert needle in str(err.value) and "\n" not in str(err.value)
