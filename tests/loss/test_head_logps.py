"""``head_logps``: the targets' log-probabilities through the head, in chunks, with gradients.

References run in float64, so the tolerances only cover fp32 products of 32 terms and a softmax
over 1,000 logits of size ~1, summed in any order (any SIMD width or GEMM library): ~1e-6."""

import pytest
import torch
import torch.nn.functional as F

from twinkle.loss.cross_entropy import IGNORE_INDEX
from twinkle.loss.head import head_logits
from twinkle.loss.head_logps import head_logps

TOL = {"atol": 2e-5, "rtol": 1e-5}


def _operands(rows=9, hidden=32, vocab=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * 0.3
    b = torch.randn(vocab, generator=g) * 0.1
    t = torch.randint(0, vocab, (rows,), generator=g)
    return h, w, b, t


def _reference(h, w, b, t):
    logits = F.linear(h.double(), w.double(), None if b is None else b.double())
    return -F.cross_entropy(logits, t, reduction="none", ignore_index=IGNORE_INDEX)


@pytest.mark.parametrize("chunk_rows", [None, 4, 1])
@pytest.mark.parametrize("with_bias", [False, True])
def test_values_and_gradients_match_float64_autograd(chunk_rows, with_bias):
    h, w, b, t = _operands()
    b = b if with_bias else None
    up = torch.randn(h.shape[0], generator=torch.Generator().manual_seed(1))
    ours_in = [x.clone().requires_grad_() for x in (h, w) + ((b,) if with_bias else ())]
    ours = head_logps(ours_in[0], ours_in[1], t, ours_in[2] if with_bias else None, chunk_rows=chunk_rows)
    (ours * up).sum().backward()
    ref_in = [x.double().requires_grad_() for x in (h, w) + ((b,) if with_bias else ())]
    ref = _reference(ref_in[0], ref_in[1], ref_in[2] if with_bias else None, t)
    (ref * up.double()).sum().backward()
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours.double(), ref.detach(), **TOL)
    for mine, theirs in zip(ours_in, ref_in, strict=True):
        assert mine.grad.dtype == mine.dtype
        torch.testing.assert_close(mine.grad.double(), theirs.grad, **TOL)


def test_ignored_targets_read_zero_and_pass_no_gradient():
    h, w, _, t = _operands()
    t[[2, 5]] = IGNORE_INDEX
    h.requires_grad_()
    out = head_logps(h, w, t, chunk_rows=4)
    out.sum().backward()
    assert out[2] == 0 and out[5] == 0 and bool((out[t != IGNORE_INDEX] < 0).all())
    assert h.grad[[2, 5]].abs().max() == 0 and h.grad[0].abs().max() > 0


def test_a_reference_pass_equals_the_policy_pass_bit_for_bit():
    # a preference loss at step 0 compares the two: exactly ln 2 needs equal bits
    h, w, _, t = _operands(rows=40)
    with torch.no_grad():
        ref = head_logps(h, w, t)
    policy = head_logps(h.clone().requires_grad_(), w, t)
    assert torch.equal(ref, policy.detach())


def test_no_rows_give_an_empty_result_that_backward_passes_through():
    h, w, b, _ = _operands(rows=0)
    h.requires_grad_()
    w.requires_grad_()
    out = head_logps(h, w, torch.zeros(0, dtype=torch.long), b)
    assert out.shape == (0,)
    (out.sum() + 0).backward()
    assert w.grad is not None and w.grad.abs().max() == 0


@pytest.mark.parametrize("with_bias", [False, True])
def test_head_logits_match_float64_with_gradients_and_equal_an_evaluation(with_bias):
    h, w, b, _ = _operands()
    b = b if with_bias else None
    up = torch.randn(h.shape[0], w.shape[0], generator=torch.Generator().manual_seed(2))
    ours_in = [x.clone().requires_grad_() for x in (h, w) + ((b,) if with_bias else ())]
    ours = head_logits(ours_in[0], ours_in[1], ours_in[2] if with_bias else None)
    (ours * up).sum().backward()
    ref_in = [x.double().requires_grad_() for x in (h, w) + ((b,) if with_bias else ())]
    ref = F.linear(ref_in[0], ref_in[1], ref_in[2] if with_bias else None)
    (ref * up.double()).sum().backward()
    torch.testing.assert_close(ours.double(), ref.detach(), **TOL)
    for mine, theirs in zip(ours_in, ref_in, strict=True):
        torch.testing.assert_close(mine.grad.double(), theirs.grad, **TOL)
    with torch.no_grad():  # an evaluation computes the training pass's logits, bit for bit
        assert torch.equal(head_logits(h, w, b), ours.detach())
