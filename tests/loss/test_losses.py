"""Token losses against a plain torch reference: loss, num_correct and every gradient."""

import pytest
import torch
import torch.nn.functional as F
from tolerances import chain_tolerances, gamma

from twinkle.loss import (
    CrossEntropyLoss,
    FusedLinearCrossEntropyLoss,
    LossView,
    build_loss,
    fused_linear_cross_entropy,
)
from twinkle.loss.fused_linear_ce import auto_chunk_rows
from twinkle.utils.errors import UserError

# (dtype, atol, rtol). atol is relative to the largest magnitude of the reference tensor, so one
# table serves losses summed over 1 or 300 rows.
TOLERANCES = [
    # fp32: both paths compute logits, softmax and gradients in fp32; only the summation order
    # differs (chunked vs one matmul): None, the bound of the chain of fp32 sums (``_sums``,
    # tolerances.chain_tolerances: 2e-5 to 1.2e-3 of the scale, the widest at 5000 logits a row);
    # a row left out or a wrong shift moves the loss by over 3e-3 of it, the gradients by more.
    (torch.float32, None, None),
    # bf16 keeps 8 significant bits. The reference adds the bias and forms the weight gradient in
    # bf16 matmuls; the fused path accumulates them in fp32 and rounds once. The two may differ by
    # two bf16 ulps of the largest element (2 * 2**-8 ~ 0.8%), so 1.6e-2 of the max.
    (torch.bfloat16, 1.6e-2, 1.6e-2),
]
# (rows, hidden, vocab, chunk_rows): one row; chunks that do not divide the rows; one chunk;
# a vocabulary the CPU path splits into blocks, the last one partial (5000 = 2 x 2048 + 904).
SHAPES = [(1, 8, 16, 4), (37, 16, 50, 8), (300, 32, 600, 64), (64, 32, 600, 1024), (20, 16, 5000, 8)]


def reference(hidden, weight, targets, bias, reduction):
    logits = F.linear(hidden, weight, bias).float()
    loss = F.cross_entropy(logits, targets, reduction="sum")
    if reduction == "mean":
        loss = loss / max(1, targets.numel())
    return loss, (logits.gather(1, targets[:, None]).squeeze(1) == logits.max(-1).values).sum()


def run_fused_fn(hidden, weight, targets, bias, reduction, chunk_rows):
    loss, correct = fused_linear_cross_entropy(hidden, weight, targets, bias, chunk_rows=chunk_rows)
    return (loss if reduction == "sum" else loss / max(1, targets.numel())), correct


def run_loss_class(cls):
    def run(hidden, weight, targets, bias, reduction, chunk_rows):
        kwargs = {"chunk_rows": chunk_rows} if cls is FusedLinearCrossEntropyLoss else {}
        view = LossView(targets=targets, hidden=hidden, weight=weight, bias=bias)
        out = cls(reduction=reduction, **kwargs).compute(view)
        return out.loss, out.num_correct

    return run


IMPLEMENTATIONS = {
    "CrossEntropyLoss": run_loss_class(CrossEntropyLoss),
    "FusedLinearCrossEntropyLoss": run_loss_class(FusedLinearCrossEntropyLoss),
    "fused_linear_cross_entropy": run_fused_fn,
}


def make_inputs(rows, hidden_size, vocab, with_bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, hidden_size, generator=g)
    weight = torch.randn(vocab, hidden_size, generator=g) * 0.3
    bias = torch.randn(vocab, generator=g) * 0.1 if with_bias else None
    targets = torch.randint(0, vocab, (rows,), generator=g)
    # Make half the targets the argmax, so num_correct is not trivially 0.
    best = F.linear(hidden, weight, bias).argmax(-1)
    targets[::2] = best[::2]
    return hidden, weight, bias, targets


def loss_and_grads(fn, inputs, dtype):
    """Run ``fn`` on fresh leaf copies of ``inputs`` in ``dtype``; return loss, correct, grads."""
    hidden, weight, bias, targets = inputs
    leaves = [
        t.detach().clone().to(dtype).requires_grad_() if t is not None else None
        for t in (hidden, weight, bias)
    ]
    loss, correct = fn(leaves[0], leaves[1], targets, leaves[2])
    loss.backward()
    grads = [leaf.grad if leaf is not None else None for leaf in leaves]
    return loss.detach(), int(correct), grads


def _sums(rows: int, hidden: int, vocab: int) -> list[int]:
    """Cross entropy's fp32 sums: the logits (hidden + bias), the softmax's normaliser (vocab),
    the loss over rows, the hidden gradient (vocab), the weight's (rows), and a few roundings per
    element (exp, log, the shift, the mean)."""
    return [hidden + 1, vocab, rows, vocab, rows, 8]


def assert_close(actual, expected, atol, rtol, what, sums=None):
    """``atol`` relative to the reference's scale; None: ``sums``' chain bound (tolerances.py)."""
    if atol is None:
        tol = chain_tolerances(sums, expected)
        torch.testing.assert_close(actual.float(), expected.float(), **tol, msg=lambda m: f"{what}: {m}")
        return
    scale = max(1.0, expected.float().abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(
        actual.float(), expected.float(), atol=atol * scale, rtol=rtol, msg=lambda m: f"{what}: {m}"
    )


@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES)
@pytest.mark.parametrize("rows, hidden_size, vocab, chunk_rows", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_matches_reference(
    impl, reduction, with_bias, rows, hidden_size, vocab, chunk_rows, dtype, atol, rtol
):
    inputs = make_inputs(rows, hidden_size, vocab, with_bias)
    fn = IMPLEMENTATIONS[impl]
    loss, correct, grads = loss_and_grads(
        lambda h, w, t, b: fn(h, w, t, b, reduction, chunk_rows), inputs, dtype
    )
    ref_loss, ref_correct, ref_grads = loss_and_grads(
        lambda h, w, t, b: reference(h, w, t, b, reduction), inputs, dtype
    )

    assert loss.dtype == torch.float32
    sums = _sums(rows, hidden_size, vocab)
    assert_close(loss, ref_loss, atol, rtol, "loss", sums)
    if dtype == torch.float32:
        assert correct == ref_correct
    else:  # a near-tie between two bf16 logits may break the other way
        assert abs(correct - ref_correct) <= 1 + rows // 100
    for name, grad, ref_grad in zip(("hidden", "weight", "bias"), grads, ref_grads, strict=True):
        if ref_grad is None:
            assert grad is None
            continue
        assert grad.dtype == dtype and grad.shape == ref_grad.shape
        assert_close(grad, ref_grad, atol, rtol, f"grad of {name}", sums)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("cls", [CrossEntropyLoss, FusedLinearCrossEntropyLoss])
def test_no_supervised_rows(cls, reduction):
    """A micro-batch (or a rank's share) whose labels are all ignored: loss 0, zero gradients."""
    hidden = torch.randn(0, 8, requires_grad=True)
    weight = torch.randn(16, 8, requires_grad=True)
    bias = torch.randn(16, requires_grad=True)
    view = LossView(targets=torch.zeros(0, dtype=torch.long), hidden=hidden, weight=weight, bias=bias)
    out = cls(reduction=reduction).compute(view)
    out.loss.backward()
    assert out.loss.item() == 0.0 and out.loss_sum.item() == 0.0
    assert out.num_tokens == 0 and int(out.num_correct) == 0
    assert hidden.grad.shape == (0, 8)
    for leaf in (weight, bias):
        assert leaf.grad is not None and not leaf.grad.any()


def test_loss_sum_is_the_sum_whatever_the_reduction():
    hidden, weight, bias, targets = make_inputs(10, 8, 16, with_bias=False)
    for cls in (CrossEntropyLoss, FusedLinearCrossEntropyLoss):
        out = cls(reduction="mean").compute(LossView(targets=targets, hidden=hidden, weight=weight))
        # the same 10 token losses summed in any order, then divided: 2 gamma(11) relative; a
        # token left out or counted twice is off by about a tenth
        torch.testing.assert_close(out.loss_sum / 10, out.loss, rtol=2 * gamma(11), atol=0)


def test_large_logits_stay_finite():
    """Logits in the thousands overflow a plain exp: the fused path must shift by each row's max."""
    hidden, weight, bias, targets = make_inputs(37, 16, 50, with_bias=True)
    inputs = (hidden * 300, weight, bias * 300, targets)
    loss, correct, grads = loss_and_grads(
        lambda h, w, t, b: fused_linear_cross_entropy(h, w, t, b, chunk_rows=8), inputs, torch.float32
    )
    ref_loss, ref_correct, ref_grads = loss_and_grads(
        lambda h, w, t, b: reference(h, w, t, b, "sum"), inputs, torch.float32
    )
    assert ref_loss.item() > 1e3 and torch.isfinite(loss)
    # logits of ~300 times the unit scale: their absolute errors, relative ones after exp, grow
    # as much, so the chain counts the logits' sum 300 times (tolerances.py)
    sums = _sums(37, 16, 50) + [300 * 17]
    assert_close(loss, ref_loss, None, None, "loss", sums)
    assert correct == ref_correct
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        assert_close(grad, ref_grad, None, None, "gradient", sums)


@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
def test_a_target_tied_at_the_top_counts_as_correct(name):
    """Row 0's target ties another token for the largest logit, after it (argmax would say
    wrong); row 1's target is below the top; row 2's is the top alone. Both losses count 2."""
    weight = torch.eye(4)
    hidden = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 5.0]])
    targets = torch.tensor([2, 2, 3])
    _, correct = IMPLEMENTATIONS[name](hidden, weight, targets, None, "sum", 2)
    assert int(correct) == 2


def test_frozen_head_gets_no_gradient():
    """LoRA freezes the head: the fused path must not compute (or return) a weight gradient."""
    hidden, weight, _, targets = make_inputs(12, 8, 16, with_bias=False)
    hidden.requires_grad_()
    loss, _ = fused_linear_cross_entropy(hidden, weight, targets, chunk_rows=5)
    loss.backward()
    assert weight.grad is None and hidden.grad is not None


def test_build_loss_by_name():
    assert isinstance(build_loss("CrossEntropyLoss"), CrossEntropyLoss)
    liger = build_loss("LigerFusedLinearCrossEntropyLoss", reduction="sum")
    assert isinstance(liger, FusedLinearCrossEntropyLoss) and liger.reduction == "sum"


def test_unknown_loss_lists_valid_names():
    with pytest.raises(UserError) as err:
        build_loss("NoSuchLoss")
    for name in (
        "NoSuchLoss",
        "CrossEntropyLoss",
        "FusedLinearCrossEntropyLoss",
        "LigerFusedLinearCrossEntropyLoss",
    ):
        assert name in str(err.value)


def test_bad_reduction_is_a_user_error():
    with pytest.raises(UserError, match="reduction"):
        build_loss("CrossEntropyLoss", reduction="none")


def test_default_chunk_is_smaller_off_the_cpu():
    """An accelerator's chunk of logits sits on top of the step's activation peak: 32 MiB of
    fp32 logits there (170 rows at SmolLM2's 49152 tokens), 128 MiB on the CPU (682 rows)."""
    assert auto_chunk_rows(49152) == 682
    assert auto_chunk_rows(49152, "cuda") == 170
    assert auto_chunk_rows(10**9, "cuda") == 1  # a vocabulary larger than a chunk: a row at a time
