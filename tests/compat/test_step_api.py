"""The step API at finer grain (upstream's names): ``forward``, ``backward``, ``clip_grad_norm``,
``step``, ``zero_grad``, ``lr_step`` compose to exactly what ``forward_backward`` +
``clip_grad_and_step`` do."""

import pytest
import torch

from twinkle.dataloader import DataLoader
from twinkle.utils.errors import UserError


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.model.named_parameters() if p.requires_grad}


def test_the_fine_grained_calls_equal_the_combined_ones_bit_for_bit(make_model, dataset):
    batches = list(DataLoader(dataset, batch_size=4))[:4]
    combined, fine = make_model(gradient_accumulation_steps=2), make_model(gradient_accumulation_steps=2)
    for model in (combined, fine):
        model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=1, num_training_steps=4)
    losses_combined, losses_fine, norms = [], [], []
    for batch in batches:
        losses_combined.append(combined.forward_backward(inputs=batch))
        combined.clip_grad_and_step(max_grad_norm=0.5)
    for i, batch in enumerate(batches):
        out = fine.forward(inputs=batch)
        losses_fine.append(fine.backward())
        assert out["loss"] == losses_fine[-1] and out["num_tokens"] > 0
        if i % 2 == 1:  # the end of each window of two
            norms.append(fine.clip_grad_norm(max_grad_norm=0.5))
            assert fine.step()
            fine.lr_step()
            fine.zero_grad()
    assert losses_fine == losses_combined
    assert all(n > 0 for n in norms)
    a, b = _weights(combined), _weights(fine)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert fine.calculate_metric()["optimizer_steps"] == combined.calculate_metric()["optimizer_steps"] == 2


def test_clip_grad_norm_takes_the_norm_type(make_model, dataset):
    batch = next(iter(DataLoader(dataset, batch_size=4)))
    model = make_model(init_lora_weights=False)
    model.forward_backward(inputs=batch)
    grads = [p.grad.clone() for p in model.optimizer_group["default"].optimizer.copies if p.grad is not None]
    norm = model.clip_grad_norm(max_grad_norm=1e9, norm_type=1)
    total = model.optimizer_group["default"].window_tokens
    assert norm == pytest.approx(sum(float(g.abs().sum()) for g in grads) / total, rel=1e-5)


def test_out_of_order_calls_say_what_to_call_first(make_model):
    model = make_model()
    with pytest.raises(UserError, match=r"call forward\(inputs=...\) before backward\(\)"):
        model.backward()
    with pytest.raises(UserError, match=r"call set_lr_scheduler\(...\) before lr_step\(\)"):
        model.lr_step()
