"""``forward_backward(..., micro_batch_size=m)``: the rows run m at a time, their gradients summed,
and the call counts as one micro-batch of the accumulation window, so the step equals the whole
batch's (the same terms summed in another order: ``test_step_semantics.assert_same_grads``)."""

import pytest
import torch
from batches import padded_batches
from test_step_semantics import assert_same_grads, capture_step_grads

from twinkle.loss import DPOLoss
from twinkle.utils.errors import UserError

ADVANTAGES = torch.tensor([1.0, -0.5, 0.25, -1.0])


@pytest.mark.parametrize("loss", ["CrossEntropyLoss", "GRPOLoss"])
def test_micro_batches_step_like_the_whole_batch(make_model, dataset, loss):
    batch = next(iter(padded_batches(dataset, batch_size=4)))
    grads, losses = [], []
    for micro in (None, 1, 3):
        model = make_model(init_lora_weights=False)
        model.set_loss(loss)
        seen = capture_step_grads(model)
        extras = {}
        if loss == "GRPOLoss":  # the current policy as the old one: every ratio is 1
            extras = {"old_logps": model.forward_only(batch)["logps"], "advantages": ADVANTAGES}
        losses.append(model.forward_backward(inputs=batch, micro_batch_size=micro, **extras))
        assert model.clip_grad_and_step(max_grad_norm=0)  # 0: no clipping
        group = model.optimizer_group["default"]
        assert (group.cur_step, group.optimizer_steps, group.local_samples) == (1, 1, 4)
        grads.append(seen[0])
    for split in grads[1:]:
        assert_same_grads(split, grads[0], batch)
    assert losses[1] == pytest.approx(losses[0], rel=1e-5) and losses[2] == pytest.approx(losses[0], rel=1e-5)


def test_a_split_call_is_one_micro_batch_of_the_window(make_model, dataset):
    model = make_model(gradient_accumulation_steps=2)
    batch = next(iter(padded_batches(dataset, batch_size=4)))
    model.forward_backward(inputs=batch, micro_batch_size=1)
    assert not model.clip_grad_and_step()  # four parts, still one of the window's two
    model.forward_backward(inputs=batch, micro_batch_size=2)
    assert model.clip_grad_and_step()


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_a_bad_micro_batch_size_is_one_line(make_model, dataset, value):
    model = make_model()
    batch = next(iter(padded_batches(dataset, batch_size=2)))
    with pytest.raises(UserError, match="micro_batch_size must be a whole number of rows >= 1"):
        model.forward_backward(inputs=batch, micro_batch_size=value)


def test_a_preference_pair_is_never_split(make_model, dataset):
    model = make_model()
    model.set_loss(DPOLoss(beta=0.1, reference_free=True))
    batch = next(iter(padded_batches(dataset, batch_size=4)))
    with pytest.raises(UserError, match=r"micro_batch_size=3 would split a \(chosen, rejected\) pair"):
        model.forward_backward(inputs=batch, micro_batch_size=3)
