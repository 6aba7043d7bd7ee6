"""Learning-rate schedules and optimizer resolution (ARCHITECTURE.md section 3, items 3 and 9)."""

import pytest
import torch

from twinkle.optim import build_optimizer, build_scheduler
from twinkle.utils.errors import UserError

BASE_LR = 0.1


def _optimizer(lr: float = BASE_LR) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def _lrs_over_horizon(name: str, warmup: int, total: int, **kwargs) -> list[float]:
    """The learning rate each of the ``total`` optimizer steps runs at."""
    opt = _optimizer()
    sched = build_scheduler(name, opt, warmup, total, **kwargs)
    lrs = []
    for _ in range(total):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize("name", ["CosineWarmupScheduler", "LinearWarmupScheduler"])
@pytest.mark.parametrize("warmup, total", [(0, 1), (0, 10), (3, 10), (1, 2), (5, 5), (2, 3)])
def test_warmup_schedule_shape(name, warmup, total):
    lrs = _lrs_over_horizon(name, warmup, total)
    assert len(lrs) == total
    assert all(lr > 0 for lr in lrs), lrs  # no optimizer step ever runs at lr 0
    assert max(lrs) == pytest.approx(BASE_LR)  # the peak is the configured lr
    ramp, decay = lrs[:warmup], lrs[warmup:]
    assert all(a < b for a, b in zip(ramp, ramp[1:], strict=False)), ramp
    if ramp:
        assert ramp[-1] == pytest.approx(BASE_LR)
    if decay:
        assert decay[0] == pytest.approx(BASE_LR)
        assert all(a >= b for a, b in zip(decay, decay[1:], strict=False)), decay
        assert lrs[-1] == min(decay)


@pytest.mark.parametrize("name", ["CosineWarmupScheduler", "LinearWarmupScheduler"])
def test_decay_reaches_its_floor_only_after_the_horizon(name):
    lrs = _lrs_over_horizon(name, 2, 20, min_lr_ratio=0.1)
    assert min(lrs) > 0.1 * BASE_LR
    assert lrs[-1] < 0.3 * BASE_LR  # it does decay most of the way


def test_torch_scheduler_by_name():
    opt = _optimizer()
    sched = build_scheduler("StepLR", opt, 0, 10, step_size=2)
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR)
    for _ in range(2):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(BASE_LR * 0.1)


def test_torch_scheduler_with_bad_arguments_is_a_user_error():
    with pytest.raises(UserError, match="StepLR"):
        build_scheduler("StepLR", _optimizer(), 0, 10, no_such_argument=1)


def test_unknown_scheduler_lists_valid_names():
    with pytest.raises(UserError) as err:
        build_scheduler("NoSuchScheduler", _optimizer(), 0, 10)
    message = str(err.value)
    for name in ("NoSuchScheduler", "CosineWarmupScheduler", "LinearWarmupScheduler", "StepLR"):
        assert name in message


@pytest.mark.parametrize("warmup, total", [(-1, 10), (0, 0)])
def test_bad_step_counts(warmup, total):
    with pytest.raises(UserError):
        build_scheduler("CosineWarmupScheduler", _optimizer(), warmup, total)


def test_unknown_optimizer_lists_valid_names():
    with pytest.raises(UserError) as err:
        build_optimizer("NoSuch", [torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    message = str(err.value)
    for name in ("NoSuch", "AdamW", "SGD", "Muon"):
        assert name in message


def test_optimizer_without_parameters_is_a_user_error():
    with pytest.raises(UserError, match="no trainable parameters"):
        build_optimizer("AdamW", [], lr=1e-3)


@pytest.mark.parametrize("optimizer_cls", [torch.optim.Muon, "Muon"])
def test_muon_over_matrices(optimizer_cls):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4, 8))]
    before = [p.detach().clone() for p in params]
    opt = build_optimizer(optimizer_cls, params, lr=1e-2, adjust_lr_fn="match_rms_adamw")
    assert isinstance(opt, torch.optim.Muon)
    sum((p**2).sum() for p in params).backward()
    opt.step()
    assert all(not torch.equal(p, b) for p, b in zip(params, before, strict=True))
    assert all(torch.isfinite(p).all() for p in params)
