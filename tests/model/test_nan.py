"""NaN/inf in the loss or a gradient: the update is skipped and counted, and N in a row stop training."""

import dataclasses
import math

import pytest
import torch
from harness import trainable

from twinkle.dataloader import DataLoader
from twinkle.loss import HeadLoss
from twinkle.utils.errors import UserError


class PoisonedLoss(HeadLoss):
    """Wraps the model's loss; the calls whose number is in ``bad`` return a NaN loss."""

    def __init__(self, inner, bad: set[int]):
        self.inner, self.bad, self.calls = inner, bad, 0
        self.reduction = inner.reduction

    def _poison(self, out):
        self.calls += 1
        if self.calls in self.bad:
            out = dataclasses.replace(out, loss_sum=out.loss_sum * float("nan"))
        return out

    def compute(self, view):
        return self._poison(self.inner.compute(view))


def _batches(dataset, n: int) -> list[dict]:
    loader = DataLoader(dataset, batch_size=2, world_size=1, rank=0)
    return [batch for _, batch in zip(range(n), loader, strict=False)]


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_nan_loss_skips_the_step_and_training_continues(make_model, dataset):
    model = make_model()
    group = model.optimizer_group["default"]
    group.loss_fn = PoisonedLoss(group.loss_fn, bad={2})
    batches = _batches(dataset, 3)

    model.forward_backward(inputs=batches[0])
    assert model.clip_grad_and_step()
    weights, steps = trainable(model), group.optimizer.optimizer.state_dict()["state"][0]["step"].clone()

    model.forward_backward(inputs=batches[1])  # NaN loss
    assert not model.clip_grad_and_step()
    _assert_same(trainable(model), weights)  # no update, and the optimizer did not count a step
    assert torch.equal(group.optimizer.optimizer.state_dict()["state"][0]["step"], steps)
    assert all(p.grad is None for p in model.model.parameters())  # the bad gradients are dropped
    metric = model.calculate_metric(is_training=True)
    assert metric["nonfinite_steps"] == 1 and metric["optimizer_steps"] == 1 and metric["step"] == 2

    model.forward_backward(inputs=batches[2])  # training goes on
    assert model.clip_grad_and_step()
    after = trainable(model)
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(after[k], weights[k]) for k in weights)
    assert model.calculate_metric(is_training=True)["nonfinite_steps"] == 1


def test_inf_gradient_is_caught_with_a_finite_loss(make_model, dataset):
    model = make_model()
    weights = trainable(model)
    lora_b = next(p for n, p in model.model.named_parameters() if "lora_B" in n)
    handle = lora_b.register_hook(lambda grad: grad + float("inf"))
    loss = model.forward_backward(inputs=_batches(dataset, 1)[0])
    handle.remove()
    assert math.isfinite(loss)  # only the gradient is poisoned
    assert not model.clip_grad_and_step()
    _assert_same(trainable(model), weights)
    assert model.calculate_metric(is_training=True)["nonfinite_steps"] == 1


def test_one_nan_micro_batch_drops_its_whole_accumulation_window(make_model, dataset):
    model = make_model(gradient_accumulation_steps=2)
    group = model.optimizer_group["default"]
    group.loss_fn = PoisonedLoss(group.loss_fn, bad={1})
    weights = trainable(model)
    first, second = _batches(dataset, 2)
    model.forward_backward(inputs=first)
    assert not model.clip_grad_and_step()  # window still open
    model.forward_backward(inputs=second)
    assert not model.clip_grad_and_step()  # window full, but it held a NaN
    _assert_same(trainable(model), weights)
    assert (group.nonfinite_steps, group.optimizer_steps, group.window_batches) == (1, 0, 0)


def test_n_nonfinite_steps_in_a_row_stop_training(make_model, dataset):
    model = make_model()
    group = model.optimizer_group["default"]
    # calls 1, 3 bad (never two in a row), then 5, 6, 7 bad: the third in a row raises.
    group.loss_fn = PoisonedLoss(group.loss_fn, bad={1, 3, 5, 6, 7})
    stepped = []
    with pytest.raises(
        UserError, match=r"training diverged: 3 optimizer steps in a row had a NaN/inf loss"
    ) as info:
        for batch in _batches(dataset, 6) + _batches(dataset, 6):
            model.forward_backward(inputs=batch)
            stepped.append(model.clip_grad_and_step(max_nonfinite_steps=3))
    assert stepped == [False, True, False, True, False, False]
    assert "lower --lr, check the data, or resume from an earlier checkpoint" in str(info.value)
    assert model.calculate_metric(is_training=True)["nonfinite_steps"] == 5
