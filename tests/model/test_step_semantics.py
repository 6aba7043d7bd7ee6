"""Step semantics of ``TransformersModel`` (ARCHITECTURE.md section 3, items 3, 4 and 8)."""

import math

import pytest
import torch
from batches import padded_batches
from tolerances import chain_tolerances, tiny_batch_sums

from twinkle.kernel import cpu_gemm as gemm
from twinkle.kernel import registry, set_switches
from twinkle.template.base import IGNORE_INDEX
from twinkle.utils.errors import UserError

LR = 1e-2


def lora_weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.model.named_parameters() if p.requires_grad}


def capture_step_grads(model) -> list[dict[str, torch.Tensor]]:
    """Record, at each optimizer step, the gradients the optimizer steps with (normalised and
    clipped), named like the trainable parameters they belong to."""
    optimizer = model.optimizer_group["default"].optimizer
    names = [n for n, p in model.model.named_parameters() if p.requires_grad]
    captured, original_step = [], optimizer.step

    def step(*args, **kwargs):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        assert len(params) == len(names)
        captured.append({n: p.grad.clone() for n, p in zip(names, params, strict=True) if p.grad is not None})
        return original_step(*args, **kwargs)

    optimizer.step = step
    return captured


def supervised_tokens(batch) -> int:
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def assert_same_grads(actual: dict, expected: dict, batch) -> None:
    """Two fp32 computations of the gradients of one loss over ``batch``: the same terms in other
    orders (split in micro-batches, fused or chunked), within the first-order bound of the tiny
    model's chain of sums over the batch (tolerances.py: ~2e-4 of each tensor's scale), plus the
    accumulation's and the normalisation's roundings. A micro-batch weighted by its own token
    count instead of the window's, or a token scored twice, moves a gradient by percents."""
    sums = tiny_batch_sums(batch["input_ids"]) + [2]
    assert actual.keys() == expected.keys() and actual
    for name, grad in expected.items():
        assert grad.abs().sum() > 0, name  # a zero gradient would prove nothing
        torch.testing.assert_close(
            actual[name], grad, **chain_tolerances(sums, grad), msg=lambda m, n=name: f"{n}: {m}"
        )


def test_optimizer_steps_after_exactly_the_accumulation_window(make_model, dataset):
    model = make_model(gradient_accumulation_steps=2)
    dataloader = padded_batches(dataset, batch_size=4)
    assert len(dataloader) == 5  # two full windows, then a partial one at the end of the data
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=1, num_training_steps=len(dataloader))
    group = model.optimizer_group["default"]
    record = []
    for batch in dataloader:
        before = lora_weights(model)
        model.forward_backward(inputs=batch)
        stepped = model.clip_grad_and_step()
        changed = any(not torch.equal(before[n], p) for n, p in lora_weights(model).items())
        record.append((group.cur_step, group.optimizer_steps, stepped, changed))
    # (micro-batches, optimizer steps, stepped now, weights changed now)
    assert record == [
        (1, 0, False, False),
        (2, 1, True, True),
        (3, 1, False, False),
        (4, 2, True, True),
        (5, 3, True, True),
    ]


def test_window_gradient_is_the_mean_over_all_its_supervised_tokens(make_model, dataset):
    """Two micro-batches with different token counts give the gradient of ONE mean loss over both."""
    halves = list(padded_batches(dataset, batch_size=2))[:2]
    whole = next(iter(padded_batches(dataset, batch_size=4)))  # the same four rows, padded together
    assert supervised_tokens(halves[0]) != supervised_tokens(halves[1])

    accumulated = make_model(gradient_accumulation_steps=2, init_lora_weights=False)
    seen = capture_step_grads(accumulated)
    for batch in halves:
        accumulated.forward_backward(inputs=batch)
        accumulated.clip_grad_and_step(max_grad_norm=0)  # 0: no clipping
    assert len(seen) == 1

    # Reference: the Hugging Face model's own mean token loss over the concatenated batch.
    reference = make_model(init_lora_weights=False)
    reference.model.train()
    reference.model(**whole).loss.backward()
    expected = {n: p.grad for n, p in reference.model.named_parameters() if p.grad is not None}
    assert_same_grads(seen[0], expected, whole)


@pytest.mark.parametrize(
    "scheduler, expected_factors",
    [
        ("CosineWarmupScheduler", [1.0, 0.75, 0.25]),  # 0.5 * (1 + cos(pi * k / 3))
        ("LinearWarmupScheduler", [1.0, 2 / 3, 1 / 3]),  # 1 - k / 3
    ],
)
def test_schedule_horizon_is_the_data_whatever_the_accumulation(
    make_model, dataset, scheduler, expected_factors
):
    model = make_model(gradient_accumulation_steps=2)
    dataloader = padded_batches(dataset, batch_size=4)
    model.set_lr_scheduler(scheduler, num_warmup_steps=0, num_training_steps=len(dataloader))
    lrs = []
    for batch in dataloader:
        model.forward_backward(inputs=batch)
        if model.clip_grad_and_step():
            lrs.append(model.calculate_metric(is_training=True)["lr"])
    assert len(lrs) == math.ceil(len(dataloader) / 2) == model.optimizer_group["default"].optimizer_steps
    assert all(lr > 0 for lr in lrs)
    assert lrs == pytest.approx([LR * f for f in expected_factors])


def test_training_metrics_are_numbers(make_model, dataset):
    model = make_model()
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=1, num_training_steps=2)
    batches = list(padded_batches(dataset, batch_size=4))[:2]
    losses = []
    for batch in batches:
        losses.append(model.forward_backward(inputs=batch))
        model.clip_grad_and_step()
    metric = model.calculate_metric(is_training=True)
    for key in ("loss", "grad_norm", "lr", "accuracy", "tokens_per_second"):
        assert type(metric[key]) in (int, float) and math.isfinite(metric[key]), (key, metric[key])
    tokens = [supervised_tokens(b) for b in batches]
    # The logged loss is the mean over all supervised tokens since the last read.
    assert metric["loss"] == pytest.approx(
        sum(loss * n for loss, n in zip(losses, tokens, strict=True)) / sum(tokens)
    )
    assert metric["supervised_tokens"] == sum(tokens)
    assert 0 <= metric["accuracy"] <= 1 and metric["grad_norm"] > 0 and metric["tokens_per_second"] > 0
    assert metric["lr"] == pytest.approx(LR)


def test_eval_metrics(make_model, dataset):
    model = make_model()
    before = lora_weights(model)
    for batch in padded_batches(dataset, batch_size=8):
        model.forward_only(inputs=batch)
        assert math.isfinite(model.calculate_loss())
    metric = model.calculate_metric(is_training=False)
    assert math.isfinite(metric["loss"]) and 0 <= metric["accuracy"] <= 1
    assert metric["samples"] == len(dataset)
    assert model.optimizer_group["default"].cur_step == 0
    assert all(p.grad is None for p in model.model.parameters())
    assert all(torch.equal(before[n], p) for n, p in lora_weights(model).items())


def test_forward_only_evaluates_and_forward_backward_trains_again(make_model, dataset):
    model = make_model()
    batch = next(iter(padded_batches(dataset, batch_size=2)))
    model.forward_backward(inputs=batch)
    assert all(m.training for m in model.model.modules())
    model.forward_only(inputs=batch)
    assert not any(m.training for m in model.model.modules())  # dropout off while evaluating
    model.forward_backward(inputs=batch)
    assert all(m.training for m in model.model.modules())


def test_forward_backward_trains_again_after_the_script_calls_eval(make_model, dataset):
    model = make_model()
    batch = next(iter(padded_batches(dataset, batch_size=2)))
    model.forward_backward(inputs=batch)
    model.model.eval()  # the script's own evaluation, not forward_only
    model.forward_backward(inputs=batch)
    assert all(m.training for m in model.model.modules())


def test_calculate_loss_needs_forward_only(make_model, dataset):
    model = make_model()
    with pytest.raises(UserError, match="forward_only"):
        model.calculate_loss()
    model.forward_only(inputs=next(iter(padded_batches(dataset, batch_size=2))))
    model.calculate_loss()
    with pytest.raises(UserError, match="forward_only"):  # each forward is recorded once
        model.calculate_loss()


def test_training_lowers_the_loss(make_model, dataset):
    batch = next(iter(padded_batches(dataset, batch_size=8)))
    model = make_model(lr=LR)
    losses = []
    for _ in range(30):
        losses.append(model.forward_backward(inputs=batch))
        model.clip_grad_and_step()
    # The tiny random model learns slowly (about 6.38 -> 6.02 here), but steadily.
    assert losses[-1] < losses[15] < losses[0] and losses[-1] < losses[0] - 0.2, losses


@pytest.mark.parametrize(
    "loss_name, reduction",
    [(None, None), ("LigerFusedLinearCrossEntropyLoss", "sum"), ("FusedLinearCrossEntropyLoss", "mean")],
)
def test_fused_task_matches_causal_lm(make_model, dataset, loss_name, reduction):
    batch = next(iter(padded_batches(dataset, batch_size=4)))
    results = []
    for task in ("causal_lm", "fused_lm_ce"):
        model = make_model(init_lora_weights=False)
        if task == "fused_lm_ce" and loss_name:
            model.set_loss(loss_name, adapter_name="default", reduction=reduction)
        seen = capture_step_grads(model)
        loss = model.forward_backward(inputs=batch, task=task)
        model.clip_grad_and_step(max_grad_norm=0)
        results.append((loss, model.calculate_metric(is_training=True)["accuracy"], seen[0]))
    (loss, accuracy, grads), (fused_loss, fused_accuracy, fused_grads) = results
    loss = torch.tensor(loss)  # the fused head sums the loss in chunks: the gradients' bound
    tol = chain_tolerances(tiny_batch_sums(batch["input_ids"]) + [2], loss)
    torch.testing.assert_close(torch.tensor(fused_loss), loss, **tol)
    assert fused_accuracy == accuracy
    assert_same_grads(fused_grads, grads, batch)


def test_unknown_task_and_loss(make_model, dataset):
    model = make_model()
    batch = next(iter(padded_batches(dataset, batch_size=2)))
    with pytest.raises(UserError) as err:
        model.forward_backward(inputs=batch, task="seq_cls")
    assert "causal_lm" in str(err.value) and "fused_lm_ce" in str(err.value)
    with pytest.raises(UserError, match="CrossEntropyLoss"):
        model.set_loss("NoSuchLoss", adapter_name="default")


@pytest.mark.parametrize("flag, base_dtype", [("auto", torch.float32), ("bfloat16", torch.bfloat16)])
def test_dtype_flag_sets_the_base_weights_and_keeps_lora_fp32(
    tiny_model_dir, dataset, monkeypatch, flag, base_dtype
):
    from peft import LoraConfig

    import twinkle
    import twinkle.kernel.lora.linear as lora_linear
    from twinkle.cli import CLI
    from twinkle.model import TransformersModel

    CLI.from_args(["--dtype", flag])
    twinkle.initialize()
    model = TransformersModel(str(tiny_model_dir))
    model.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    model.set_optimizer("AdamW", lr=1e-2)
    frozen = {p.dtype for p in model.model.parameters() if not p.requires_grad}
    trainable = {p.dtype for p in model.model.parameters() if p.requires_grad}
    assert frozen == {base_dtype} and trainable == {torch.float32}
    fused = []
    original = lora_linear._LoraLinear.apply
    monkeypatch.setattr(lora_linear._LoraLinear, "apply", lambda *a: fused.append(1) or original(*a))
    before = lora_weights(model)
    batch = next(iter(padded_batches(dataset, batch_size=4)))
    loss = model.forward_backward(inputs=batch)
    model.clip_grad_and_step()
    assert math.isfinite(float(loss)) and fused  # the one-node LoRA ran, in both dtypes
    after = lora_weights(model)
    assert any(not torch.equal(before[k], after[k]) for k in before)


def _train(model, batches) -> list[float]:
    losses = []
    for batch in batches:
        losses.append(model.forward_backward(inputs=batch))
        model.clip_grad_and_step()
    return losses


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
def test_a_cpu_model_packs_its_frozen_weights_and_trains_the_same(make_model, dataset, monkeypatch):
    set_switches({"TWINKLE_ONEDNN": "1"})  # every shape to oneDNN, whichever is faster here
    registry.forget()
    monkeypatch.setattr(gemm, "_packed", {})
    batches = list(padded_batches(dataset, batch_size=4))[:3]
    model = make_model()
    linears = [m.weight for m in model.model.modules() if isinstance(m, torch.nn.Linear)]
    frozen = [w for w in linears if not w.requires_grad]
    assert frozen and all(id(w) in gemm._packed for w in frozen)
    assert gemm.packed_bytes() == sum(w.nbytes for w in frozen)  # and no trainable weight
    packed_losses = _train(model, batches)

    monkeypatch.setattr(gemm, "pack_frozen", lambda weights: 0)
    dense_model = make_model()
    assert not any(id(w) in gemm._packed for w in dense_model.model.parameters())
    dense_losses = torch.tensor(_train(dense_model, batches))
    # packed and plain weights: oneDNN's kernels sum in other orders. Each step's loss within the
    # first-order bound of the model's chain of sums (~2e-4 of it); AdamW's carry-over of the
    # steps before stays far below it over 3 steps (kernel/test_kernel_convergence.py measures it
    # against a float64 run: under 1/200 of the bound in 8 steps). A weight packed from the wrong
    # matrix or left stale after a step changes the loss by percents.
    for i, (dense, packed) in enumerate(zip(dense_losses, packed_losses, strict=True)):
        tol = chain_tolerances(tiny_batch_sums(batches[i]["input_ids"]), dense)
        torch.testing.assert_close(torch.tensor(packed), dense, **tol, msg=lambda m, i=i: f"step {i}: {m}")
