"""Upstream's loss and metric classes against plain torch, and with ``set_loss``/``add_metric``.

Upstream's convention: ``loss(inputs, outputs)`` with ``inputs["labels"]`` already shifted (each
position's target, -100 where none) and ``outputs["logits"]``/``["logps"]``."""

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from batches import padded_batches
from tolerances import UNIT_ROUNDOFF, assert_within, chain_tolerances, tiny_batch_sums

from twinkle.loss import (
    ChunkedCrossEntropyLoss,
    CrossEntropyLoss,
    FusedLinearCrossEntropyLoss,
    LigerFusedLinearCrossEntropyLoss,
    LossView,
    MSELoss,
    build_loss,
)
from twinkle.metric import Accuracy, LossMetric, TrainMetric
from twinkle.utils.errors import UserError

B, L, V, H = 3, 7, 11, 5
# fp32 throughout: the losses and the references sum the same terms in other orders. Their
# chains of sums (tolerances.chain_tolerances, ~5e-6 of each tensor's scale): the softmax over
# the V logits, a few roundings per token (log, exp, the subtraction, the mean's division), the
# sum over the batch's tokens; through a head, its H-term products first and its weight's
# gradient over the rows. A token scored that should not be, or dropped, moves a loss by about
# ln(V) ~ 2.4 and its gradient row by a whole softmax.
CE_SUMS = [V, 4, B * L]
HEAD_SUMS = [H, V, 4, B * L]


def _close(actual, expected, sums=CE_SUMS):
    torch.testing.assert_close(actual, expected, **chain_tolerances(sums, expected))


def _labels(seed=0, ignore=-100):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (B, L), generator=g)
    labels[:, :2] = ignore  # a prompt
    labels[2, 5:] = ignore  # padding
    return labels


def _logits(seed=1):
    return torch.randn(B, L, V, generator=torch.Generator().manual_seed(seed), requires_grad=True)


def _reference_ce(logits, labels, reduction, ignore=(-100,)):
    mask = torch.ones_like(labels, dtype=torch.bool)
    for value in ignore:
        mask &= labels != value
    return F.cross_entropy(logits[mask], labels[mask], reduction=reduction), int(mask.sum())


def _grad(loss, leaf):
    (grad,) = torch.autograd.grad(loss, leaf, retain_graph=True)
    return grad


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(
    "make",
    [CrossEntropyLoss, lambda **kw: ChunkedCrossEntropyLoss(chunk_size=4, **kw)],
    ids=["ce", "chunked"],
)
def test_cross_entropy_from_logits_and_logps(make, reduction):
    labels, logits = _labels(), _logits()
    expected, count = _reference_ce(logits, labels, reduction)
    out = make(reduction=reduction)({"labels": labels}, {"logits": logits})
    _close(out["loss"], expected)
    _close(_grad(out["loss"], logits), _grad(expected, logits))
    assert int(out["num_tokens"]) == (count if reduction == "sum" else 0)  # upstream's signal of a mean
    logps = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    from_logps = make(reduction=reduction)({"labels": labels}, {"logps": logps})
    _close(from_logps["loss"], expected)


def test_ignore_index_and_dft():
    labels, logits = _labels(), _logits()
    expected, _ = _reference_ce(logits, labels, "sum", ignore=(-100, 3))
    out = CrossEntropyLoss(ignore_index=3, reduction="sum")({"labels": labels}, {"logits": logits})
    _close(out["loss"], expected)
    # DFT: each token's -log p weighted by p, which is not differentiated (arXiv 2508.05629)
    mask = labels != -100
    logp = torch.log_softmax(logits[mask], -1).gather(-1, labels[mask][:, None]).squeeze(-1)
    reference = (-(logp.detach().exp()) * logp).mean()
    for make in (CrossEntropyLoss, lambda **kw: ChunkedCrossEntropyLoss(chunk_size=4, **kw)):
        dft = make(dft=True)({"labels": labels}, {"logits": logits})
        _close(dft["loss"], reference)
        _close(_grad(dft["loss"], logits), _grad(reference, logits))


@pytest.mark.parametrize(
    "loss",
    [
        CrossEntropyLoss(reduction="sum", ignore_index=4),
        CrossEntropyLoss(reduction="sum", dft=True),
        ChunkedCrossEntropyLoss(chunk_size=3, reduction="sum"),
        ChunkedCrossEntropyLoss(chunk_size=3, reduction="sum", dft=True),
        LigerFusedLinearCrossEntropyLoss(chunk_rows=3),
    ],
    ids=["ce-ignore", "ce-dft", "chunked", "chunked-dft", "liger"],
)
def test_the_model_convention_matches_torch(loss):
    """``loss.compute(view)`` on the model's rows view: hidden states of the supervised rows and the head."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(10, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    targets = torch.randint(0, V, (10,), generator=g)
    keep = targets != getattr(loss, "ignore_index", -100)
    logits = F.linear(hidden[keep], weight)
    if getattr(loss, "dft", False):
        logp = -F.cross_entropy(logits, targets[keep], reduction="none")
        expected = (-(logp.detach().exp()) * logp).sum()
    else:
        expected = F.cross_entropy(logits, targets[keep], reduction="sum")
    out = loss.compute(LossView(targets=targets, hidden=hidden, weight=weight))
    assert out.num_tokens == int(keep.sum()) and int(out.num_correct) == int(
        (logits.argmax(-1) == targets[keep]).sum()
    )
    _close(out.loss, expected, HEAD_SUMS)
    for leaf in (hidden, weight):
        _close(_grad(out.loss, leaf), _grad(expected, leaf), HEAD_SUMS)


def test_fused_losses_take_upstreams_hidden_states_and_head():
    labels = _labels()
    hidden = torch.randn(B, L, H, generator=torch.Generator().manual_seed(3), requires_grad=True)
    head = torch.nn.Linear(H, V, bias=False)
    expected, count = _reference_ce(head(hidden), labels, "sum")
    for loss in (LigerFusedLinearCrossEntropyLoss(), FusedLinearCrossEntropyLoss()):
        out = loss({"labels": labels}, {"logits": hidden, "lm_head": head})
        _close(out["loss"], expected, HEAD_SUMS)
        assert out["num_tokens"] == count
        # without the head, the logits are real logits: plain cross-entropy
        plain = loss({"labels": labels}, {"logits": head(hidden)})
        _close(plain["loss"], expected, HEAD_SUMS)
    assert isinstance(build_loss("LigerFusedLinearCrossEntropyLoss"), FusedLinearCrossEntropyLoss)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: LigerFusedLinearCrossEntropyLoss(label_smoothing=0.1),
            r"not supported yet: label_smoothing",
        ),
        (lambda: LigerFusedLinearCrossEntropyLoss(softcap=30.0), r"not supported yet: softcap"),
        (lambda: ChunkedCrossEntropyLoss(chunk_size=0), r"chunk_size must be a positive integer"),
        (
            lambda: CrossEntropyLoss(reduction="none"),
            r"reduction='none' is not supported; use one of sum, mean",
        ),
        (lambda: build_loss("MSELoss", reduction="sum"), r"loss MSELoss: MSELoss\(\) takes no arguments"),
    ],
)
def test_unsupported_arguments_are_user_errors(make, message):
    with pytest.raises(UserError, match=message):
        make()


def test_mse():
    g = torch.Generator().manual_seed(4)
    preds, labels = torch.randn(6, 1, generator=g, requires_grad=True), torch.randn(6, 1, generator=g)
    out = MSELoss()({"labels": labels}, {"logits": preds})
    _close(out["loss"], F.mse_loss(preds, labels), [6, 3])  # 6 squares summed, sub/square/divide
    with pytest.raises(UserError, match=r"logits \(3, 7, 11\) and labels \(3, 7\) differ in shape"):
        MSELoss()({"labels": _labels()}, {"logits": _logits()})


def test_accuracy_from_logits_and_from_the_models_counts():
    labels, logits = _labels(), _logits()
    mask = labels != -100
    metric = Accuracy()
    metric.accumulate({"labels": labels}, {"logits": logits})
    metric.accumulate({"labels": labels}, {"num_correct": 3, "num_tokens": 10, "logits": None})
    correct = int(((logits.argmax(-1) == labels) & mask).sum()) + 3
    total = int(mask.sum()) + 10
    assert metric.calculate() == {
        "accuracy": correct / total,
        "correct_tokens": correct,
        "total_tokens": total,
    }
    assert metric.calculate() == {}  # calculate resets
    completion = torch.zeros_like(labels)
    completion[:, -2:] = 1
    metric.accumulate({"labels": labels, "completion_mask": completion}, {"logits": logits})
    assert metric.calculate()["total_tokens"] == 2 * B


def test_loss_metric_sum_and_mean():
    metric = LossMetric()
    metric.accumulate({}, {"loss": 6.0, "num_tokens": 4}, loss_reduction="sum", grad_norm=0.5)
    metric.accumulate({}, {"loss": torch.tensor(3.0), "num_tokens": 2}, loss_reduction="sum")
    assert metric.calculate() == {"loss": 9.0 / 6, "grad_norm": 0.5}
    metric.accumulate({}, {"loss": 2.0})
    metric.accumulate({}, {"loss": 4.0})  # mean reduction: the mean of the micro-batches
    assert metric.calculate() == {"loss": 3.0}
    labels = torch.tensor([[-100, 1, 2], [3, -100, -100]])
    metric.accumulate({"labels": labels}, {"loss": 6.0}, loss_reduction="sum")  # tokens from the labels
    assert metric.calculate() == {"loss": 2.0} and metric.calculate() == {}


def test_train_metric():
    metric = TrainMetric()
    metric.accumulate(None, None, lr=1e-4, step=10, gradient_accumulation_steps=2)
    out = metric.calculate()
    assert (
        out["lr"] == 1e-4
        and out["iters"] == 5
        and out["iters_per_second"] > 0
        and out["elapsed_seconds"] >= 0
    )
    metric.accumulate(None, None, lr=[1e-4, 2e-4], step=12)
    assert {k: v for k, v in metric.calculate().items() if k.startswith("lr")} == {
        "lr/group0": 1e-4,
        "lr/group1": 2e-4,
    }


def _upstream_style_ce(inputs, outputs):
    """A loss the way upstream documents one: a plain callable of (inputs, outputs)."""
    mask = inputs["labels"] != -100
    return {"loss": -(outputs["logps"] * mask).sum(), "num_tokens": mask.sum()}


def _mean_ce(inputs, outputs):
    mask = inputs["labels"] != -100
    return -(outputs["logps"] * mask).sum() / mask.sum()  # a bare scalar: a mean


@pytest.mark.parametrize(
    ("loss_cls", "kwargs", "exact"),
    [
        (CrossEntropyLoss(reduction="sum"), {}, True),
        (CrossEntropyLoss, {"reduction": "mean"}, True),  # the reported value only: same training
        (ChunkedCrossEntropyLoss, {"chunk_size": 5}, False),
        (_upstream_style_ce, {}, False),
        (_mean_ce, {}, False),
    ],
    ids=["instance", "class", "chunked", "callable-sum", "callable-mean"],
)
def test_set_loss_takes_classes_instances_and_callables(make_model, dataset, loss_cls, kwargs, exact):
    batches = list(padded_batches(dataset, batch_size=4))[:2]
    reference, model = make_model(init_lora_weights=False), make_model(init_lora_weights=False)
    model.set_loss(loss_cls, **kwargs)
    first_grads = _first_step_grads(reference)
    for step, batch in enumerate(batches):
        expected, actual = reference.forward_backward(inputs=batch), model.forward_backward(inputs=batch)
        if exact:
            assert actual == expected
        else:  # another order of the same token losses: the model's chain bound (~2e-4 of it)
            expected = torch.tensor(expected)
            tol = chain_tolerances(tiny_batch_sums(batch["input_ids"]), expected)
            torch.testing.assert_close(torch.tensor(actual), expected, **tol)
        reference.clip_grad_and_step()
        model.clip_grad_and_step()
        if step == 0 or exact:  # exact: bit for bit after every step
            _assert_same_first_step(model, reference, first_grads, batch, exact)
    metrics, expected = model.calculate_metric(), reference.calculate_metric()
    assert metrics["accuracy"] == expected["accuracy"]
    assert metrics["supervised_tokens"] == expected["supervised_tokens"]


def _first_step_grads(model) -> dict:
    """The gradients ``model``'s first optimizer step steps with (clipped), by parameter name."""
    optimizer = model.optimizer_group["default"].optimizer
    names = {id(p): n for n, p in model.model.named_parameters()}
    grads, step = {}, optimizer.step

    def capture(*args, **kwargs):
        if not grads:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            grads.update({names[id(p)]: p.grad.clone() for p in params if p.grad is not None})
        return step(*args, **kwargs)

    optimizer.step = capture
    return grads


def _assert_same_first_step(model, reference, grads: dict, batch, exact: bool) -> None:
    """After the first AdamW step from the same weights. Bit for bit where the loss is the same
    computation. Else the gradients differ by at most ``e`` (the model's chain bound), and a first
    step moves each weight by lr * g / (|g| + eps): by lr * min(2, 2 e / (|g| + eps)) more or less
    (a gradient within ``e`` of zero may flip its step), plus a few roundings of the weight. A loss
    of the wrong sign or on other tokens moves most weights by about lr."""
    params = {n: p for n, p in model.model.named_parameters() if p.requires_grad}
    lr = model.optimizer_group["default"].optimizer.param_groups[0]["lr"]
    sums = tiny_batch_sums(batch["input_ids"]) + [2]  # and the clipping's norm and scaling
    assert grads and grads.keys() <= params.keys()
    for name, ref in reference.model.named_parameters():
        if not ref.requires_grad:
            continue
        if exact:
            torch.testing.assert_close(params[name], ref, atol=0, rtol=0)
            continue
        g = grads[name].double().abs()
        tol = chain_tolerances(sums, grads[name])
        e = tol["atol"] + tol["rtol"] * g
        bound = (
            lr * torch.clamp(2 * e / (g + 1e-8), max=2)
            + 4 * UNIT_ROUNDOFF[torch.float32] * ref.double().abs()
        )
        assert_within(params[name].detach(), ref.detach(), bound, name)


def test_losses_the_model_cannot_run_say_so(make_model, dataset):
    batch = next(iter(padded_batches(dataset, batch_size=2)))
    model = make_model()
    model.set_loss(MSELoss)
    with pytest.raises(
        UserError, match=r"MSELoss: logits \(2, \d+, \d+\) and labels \(2, \d+\) differ in shape"
    ):
        model.forward_backward(inputs=batch)
    model.set_loss(lambda inputs, outputs: 3.0)
    with pytest.raises(UserError, match=r"returned float; return a scalar tensor"):
        model.forward_backward(inputs=batch)
    for loss in (CrossEntropyLoss(dft=True), _upstream_style_ce):
        model.set_loss(loss)
        with pytest.raises(UserError, match=r"task='fused_lm_ce' replaces the loss .* use task='causal_lm'"):
            model.forward_backward(inputs=batch, task="fused_lm_ce")
    with pytest.raises(UserError, match=r"a loss instance and keywords \['reduction'\]"):
        model.set_loss(CrossEntropyLoss(), reduction="sum")
    with pytest.raises(UserError, match=r"set_loss: 3 is neither a loss name"):
        model.set_loss(3)


RANKS = """
import json, multiprocessing, sys

import torch.distributed as dist

from twinkle.metric import Accuracy, LossMetric


def on_rank(rank, init_file, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        accuracy, loss = Accuracy(), LossMetric()
        accuracy.accumulate({}, {"num_correct": rank + 1, "num_tokens": 10 * (rank + 1)})
        loss.accumulate(
            {}, {"loss": 3.0 * (rank + 1), "num_tokens": rank + 1}, loss_reduction="sum", grad_norm=rank + 0.5
        )
        results.put((rank, {**accuracy.calculate(), **loss.calculate()}))
    finally:
        dist.destroy_process_group()


# forked from this process, which has imported and run nothing else
context = multiprocessing.get_context("fork")
results = context.SimpleQueue()
ranks = [context.Process(target=on_rank, args=(r, sys.argv[1], results)) for r in (0, 1)]
for proc in ranks:
    proc.start()
for proc in ranks:
    proc.join(120)
assert [proc.exitcode for proc in ranks] == [0, 0], [proc.exitcode for proc in ranks]
print(json.dumps(dict(results.get() for _ in ranks)))
"""


def test_metrics_reduce_over_ranks(tmp_path):
    """Two gloo ranks with different counts: both report the totals (and the largest grad norm).
    The ranks are forked from a fresh interpreter that imported only ``twinkle.metric``."""
    done = subprocess.run(
        [sys.executable, "-c", RANKS, str(tmp_path / "init")], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = {int(rank): metrics for rank, metrics in json.loads(done.stdout.splitlines()[-1]).items()}
    expected = {
        "accuracy": 3 / 30,
        "correct_tokens": 3,
        "total_tokens": 30,
        "loss": 9.0 / 3,
        "grad_norm": 1.5,
    }
    assert results == {0: expected, 1: expected}
