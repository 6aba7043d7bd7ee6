"""Upstream's 'default' schedule (``ParamScheduler``) and torch schedules through
``build_scheduler``: their rates against the formulas, the horizon a run gives, the refusals."""

import math

import pytest
import torch

from twinkle.optim import ParamScheduler, build_optimizer, build_scheduler
from twinkle.utils.errors import UserError


def _optimizer(lr=1.0):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def _rates(scheduler, steps):
    out = []
    for _ in range(steps):
        out.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize(
    ("style", "decay"),
    [
        ("cosine", lambda r: 0.5 * (1 + math.cos(math.pi * r))),
        ("linear", lambda r: 1 - r),
        ("constant", lambda r: 1),
    ],
)
def test_warmup_then_decay(style, decay):
    scheduler = ParamScheduler(
        _optimizer(), lr_decay_steps=6, max_lr=2.0, min_lr=0.5, lr_warmup_steps=2, lr_decay_style=style
    )
    warm = [1.0, 2.0]  # (k + 1) / warmup of the way from init_lr 0: no step at 0
    tail = [0.5 + 1.5 * decay(r) for r in (0, 1 / 4, 2 / 4, 3 / 4)]
    if style == "constant":
        tail = [2.0] * 4
    assert _rates(scheduler, 8) == pytest.approx(
        warm + tail + tail[-1:] * 2
    )  # past the horizon: the last rate


def test_max_lr_defaults_to_the_optimizers_and_state_round_trips():
    scheduler = ParamScheduler(_optimizer(lr=3e-4), lr_decay_steps=10)
    _rates(scheduler, 3)
    again = ParamScheduler(_optimizer(lr=3e-4), lr_decay_steps=10)
    again.load_state_dict(scheduler.state_dict())
    assert again.lr_at(again.last_epoch) == scheduler.lr_at(scheduler.last_epoch) < 3e-4


def test_build_scheduler_names_and_horizons():
    assert isinstance(build_scheduler("default", _optimizer(), 0, None, lr_decay_steps=4), ParamScheduler)
    assert isinstance(build_scheduler("OptimizerParamScheduler", _optimizer(), 1, 4), ParamScheduler)
    cosine = build_scheduler("CosineAnnealingLR", _optimizer(), 0, 7)  # the run's horizon fills T_max
    assert cosine.T_max == 7
    assert build_scheduler("CosineAnnealingLR", _optimizer(), 0, 7, T_max=3).T_max == 3  # the call's wins
    with pytest.raises(UserError, match="needs num_training_steps"):
        build_scheduler("CosineWarmupScheduler", _optimizer(), 0, None)
    with pytest.raises(UserError, match="StepLR has no warm-up"):
        build_scheduler("StepLR", _optimizer(), 3, None, step_size=2)
    with pytest.raises(UserError, match="lr_decay_steps"):
        build_scheduler("default", _optimizer(), 0, None)
    with pytest.raises(UserError, match="start_wd is not supported"):
        build_scheduler("default", _optimizer(), 0, 4, start_wd=0.0)


def test_the_default_optimizer_is_adamw_with_megatrons_keywords():
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = build_optimizer("default", [weight], lr=1e-3, adam_beta1=0.8, adam_eps=1e-6, bf16=True)
    assert isinstance(optimizer, torch.optim.AdamW)
    group = optimizer.param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.8, 0.999), 1e-6, 0.01)
    with pytest.raises(UserError, match="clip_grad is the model's"):
        build_optimizer("default", [weight], lr=1e-3, clip_grad=1.0)
