"""The step API at finer grain (upstream's names): ``forward``, ``backward``, ``clip_grad_norm``,
``step``, ``zero_grad``, ``lr_step``; ``clip_grad_and_step`` is those calls composed, so there is
one implementation of the optimizer step."""

import inspect
import math

import pytest
import torch
from batches import padded_batches
from tolerances import gamma

from twinkle.template.base import IGNORE_INDEX
from twinkle.utils.errors import UserError

STEP_CALLS = ("clip_grad_norm", "step", "lr_step", "zero_grad")


def _spy_on_step_calls(model) -> list[tuple[str, dict, object]]:
    """Record each call of ``STEP_CALLS`` on ``model`` (name, bound arguments, result) as it returns."""
    calls = []
    for name in STEP_CALLS:
        original = getattr(model, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            bound = inspect.signature(_original).bind(*args, **kwargs).arguments
            result = _original(*args, **kwargs)
            calls.append((_name, dict(bound), result))
            return result

        setattr(model, name, spy)
    return calls


def test_clip_grad_and_step_is_the_fine_grained_calls_composed(make_model, dataset):
    """An open window makes no call; a full one is clip_grad_norm, step, lr_step, zero_grad with
    the caller's arguments, and no lr_step when the step is skipped (a NaN/inf gradient, no
    supervised token): the schedule follows the optimizer steps, and ``grad_norm`` is the stepped
    window's norm."""
    b0, b1, b2, b3 = list(padded_batches(dataset, batch_size=4))[:4]
    no_tokens = {**b2, "labels": torch.full_like(b2["labels"], IGNORE_INDEX)}
    model = make_model(gradient_accumulation_steps=2)
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=1, num_training_steps=8)
    group = model.optimizer_group["default"]
    lora_b = next(p for n, p in model.model.named_parameters() if "lora_B" in n)
    calls = _spy_on_step_calls(model)
    windows = []
    for i, batch in enumerate((b0, b1, b2, b3, no_tokens, no_tokens, b1, b0)):
        hook = lora_b.register_hook(lambda grad: grad + float("inf")) if i == 2 else None
        model.forward_backward(inputs=batch)
        if hook is not None:
            hook.remove()
        stepped = model.clip_grad_and_step(max_grad_norm=0.5, max_nonfinite_steps=3)
        if i % 2 == 0:  # the window is open: nothing runs, nothing is closed
            assert (stepped, calls, group.window_batches) == (False, [], 1)
            continue
        windows.append((stepped, [c[0] for c in calls], calls[0][2], group.last_grad_norm))
        assert calls[0][1]["max_grad_norm"] == 0.5 and calls[1][1]["max_nonfinite_steps"] == 3
        assert group.window_batches == 0 and all(p.grad is None for p in model.model.parameters())
        calls.clear()
    full, skipped = list(STEP_CALLS), ["clip_grad_norm", "step", "zero_grad"]
    (ok1, calls1, norm1, last1), (nan, calls2, norm2, last2), (empty, calls3, norm3, last3), ok2 = windows
    assert ok1 and calls1 == full and math.isfinite(norm1) and norm1 > 0 and last1 == norm1
    assert not nan and calls2 == skipped and not math.isfinite(norm2) and last2 == norm1
    assert not empty and calls3 == skipped and norm3 == 0.0 and last3 == norm1
    assert ok2[0] and ok2[1] == full and ok2[3] == ok2[2] != norm1
    assert (group.optimizer_steps, group.nonfinite_steps, group.skipped_steps) == (2, 1, 1)
    assert group.lr_scheduler.last_epoch == 2  # advanced once per optimizer step, not per window


def test_clip_grad_norm_takes_the_norm_type(make_model, dataset):
    batch = next(iter(padded_batches(dataset, batch_size=4)))
    model = make_model(init_lora_weights=False)
    model.forward_backward(inputs=batch)
    grads = [p.grad.clone() for p in model.optimizer_group["default"].optimizer.copies if p.grad is not None]
    norm = model.clip_grad_norm(max_grad_norm=1e9, norm_type=1)
    total = model.optimizer_group["default"].window_tokens
    # the same non-negative terms summed in fp32 in other orders (per tensor, then over the
    # tensors), and a division: each within gamma(largest tensor + tensors + 1) of the exact sum,
    # relative (~3e-5 here); the L2 norm instead is off by a factor, a tensor left out by its share
    rel = 2 * gamma(max(g.numel() for g in grads) + len(grads) + 1)
    assert norm == pytest.approx(sum(float(g.abs().sum()) for g in grads) / total, rel=rel, abs=0)


def test_out_of_order_calls_say_what_to_call_first(make_model):
    model = make_model()
    with pytest.raises(UserError, match=r"call forward\(inputs=...\) before backward\(\)"):
        model.backward()
    with pytest.raises(UserError, match=r"call set_lr_scheduler\(...\) before lr_step\(\)"):
        model.lr_step()
