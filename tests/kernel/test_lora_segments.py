"""The segmented LoRA kernel (``kernel/lora/segments.c``) against a float64 reference of the loop
it replaces, the same bits on any thread count, and the calls it refuses.

Tolerance: ``out[t, n] = base + s * sum_j (sum_k x_k a_jk) b_nj`` in fp32, in any order. Each
term ``s x_k a_jk b_nj`` sees at most K roundings in its sum over k (its product and K - 1
additions, in any order, FMA or not), one for the scale, one for the product by b_nj, r - 1 for
the sum over j and one for the addition to base: K + r + 2 in all, so every element is within
gamma(K + r + 2) * (|base| + |s| sum_j (sum_k |x_k a_jk|) |b_nj|) of exact (Higham, section 3.1;
``tolerances.py``). A wrong adapter, scale or token moves an element by about its magnitude."""

import pytest
import torch
from thread_counts import on_threads
from tolerances import assert_within, gamma

from twinkle.kernel import registry
from twinkle.kernel.lora import segments

needs_kernel = pytest.mark.skipif(segments.library() is None, reason="no C compiler here")


def _problem(tokens, k, n, spans, seed=0):
    """``(out, x, runs)``: a base output, an input and one adapter per ``(start, end, rank)``."""
    g = torch.Generator().manual_seed(seed)
    out, x = torch.randn(tokens, n, generator=g), torch.randn(tokens, k, generator=g)
    runs = [
        (start, end, torch.randn(rank, k, generator=g), torch.randn(n, rank, generator=g), 0.5 + i)
        for i, (start, end, rank) in enumerate(spans)
    ]
    return out, x, runs


def _check(out, base, x, runs):
    """``out`` is ``base`` plus each run's product within the bound above; rows of no run keep
    ``base``'s bits."""
    expected, magnitude = base.double(), base.double().abs()
    covered = torch.zeros(base.shape[0], dtype=torch.bool)
    bound = torch.zeros_like(expected)
    for start, end, a, b, scale in runs:
        rows = slice(start, end)
        xs = x[rows].double()
        expected[rows] += scale * (xs @ a.double().t()) @ b.double().t()
        magnitude[rows] += abs(scale) * (xs.abs() @ a.double().abs().t()) @ b.double().abs().t()
        bound[rows] = gamma(x.shape[1] + a.shape[0] + 2) * magnitude[rows]
        covered[rows] = True
    assert_within(out[covered], expected[covered], bound[covered], "tokens of a run")
    assert torch.equal(out[~covered], base[~covered])  # untouched, bit for bit


SHAPES = {
    # tokens, K, N, (start, end, rank) per run
    "ranks 1 to 64, tails of K and N": (
        60,
        37,
        45,
        [(0, 7, 1), (7, 20, 4), (20, 33, 8), (33, 50, 16), (50, 60, 64)],
    ),
    "gaps and an empty run": (50, 64, 40, [(3, 9, 8), (9, 9, 8), (15, 30, 2), (40, 47, 5)]),
    "runs out of order": (30, 24, 17, [(20, 30, 3), (0, 10, 8), (10, 20, 7)]),
    "one token": (1, 19, 23, [(0, 1, 8)]),
    "one token of many": (9, 40, 33, [(4, 5, 16)]),
    "model-like": (406, 576, 192, [(0, 100, 8), (100, 203, 8), (203, 305, 8), (305, 406, 8)]),
    "K and N below a vector": (12, 5, 3, [(0, 5, 2), (6, 12, 9)]),
}


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_the_runs_equal_the_float64_loop(shape):
    tokens, k, n, spans = shape
    out, x, runs = _problem(tokens, k, n, spans)
    base = out.clone()
    with torch.no_grad():
        assert segments.add_segments(out, x, runs)
    _check(out, base, x, runs)


@needs_kernel
def test_parameters_under_grad_mode_without_grad_and_rank_at_the_limit():
    out, x, runs = _problem(20, 33, 47, [(0, 12, segments.MAX_RANK), (12, 20, 3)], seed=1)
    runs = [
        (s, e, torch.nn.Parameter(a, requires_grad=False), torch.nn.Parameter(b, False), c)
        for s, e, a, b, c in runs
    ]
    base = out.clone()
    assert segments.add_segments(out, x, runs)  # grad mode on, nothing that requires grad
    _check(out, base, x, runs)


@needs_kernel
def test_non_contiguous_adapter_weights_are_copied():
    out, x, runs = _problem(16, 24, 40, [(0, 16, 8)], seed=2)
    _, _, a, b, scale = runs[0]
    runs = [(0, 16, a.t().contiguous().t(), b.t().contiguous().t(), scale)]  # same values, transposed strides
    assert not runs[0][2].is_contiguous() and not runs[0][3].is_contiguous()
    base = out.clone()
    assert segments.add_segments(out, x, runs)
    _check(out, base, x, runs)


@needs_kernel
@pytest.mark.parametrize(("k", "n"), [(576, 576), (37, 45)])
def test_the_same_bits_on_any_thread_count(k, n):
    out, x, runs = _problem(406, k, n, [(0, 101, 8), (101, 203, 16), (203, 306, 1), (306, 406, 5)], seed=3)
    one, two, three = out.clone(), out.clone(), out.clone()
    assert on_threads(1, lambda: segments.add_segments(one, x, runs))
    assert on_threads(2, lambda: segments.add_segments(two, x, runs))
    assert on_threads(3, lambda: segments.add_segments(three, x, runs))
    assert torch.equal(one, two) and torch.equal(one, three)  # one thread's sum in a fixed order
    _check(one, out, x, runs)


@needs_kernel
def test_no_runs_or_only_empty_ones_change_nothing():
    out, x, runs = _problem(8, 16, 16, [(3, 3, 4)])
    base = out.clone()
    assert segments.add_segments(out, x, runs)
    assert segments.add_segments(out, x, [])
    assert torch.equal(out, base)


def _refused(out, x, runs):
    base = out.clone()
    assert segments.add_segments(out, x, runs) is False
    assert torch.equal(out, base)  # left alone: the caller runs its own loop


def test_what_it_refuses_leaves_out_alone():
    out, x, runs = _problem(20, 16, 24, [(0, 10, 4), (10, 20, 8)])
    a, b = runs[0][2], runs[0][3]
    _refused(out.double(), x.double(), [(s, e, a.double(), b.double(), c) for s, e, a, b, c in runs])
    _refused(out, x.double(), runs)
    _refused(out, x, [(0, 10, a.double(), b, 1.0)])
    _refused(out, x, [(0, 10, a, b.double(), 1.0)])
    _refused(out.t().contiguous().t(), x, runs)  # not contiguous
    _refused(out, x.t().contiguous().t(), runs)
    _refused(out[None], x, runs)  # not 2-D
    _refused(out, x[:19], runs)  # tokens differ
    _refused(out, x, [(0, 10, a[:, :15], b, 1.0)])  # A's K is not x's
    _refused(out, x, [(0, 10, a, b[:23], 1.0)])  # B's N is not out's
    _refused(out, x, [(0, 10, a, b[:, :3], 1.0)])  # B's rank is not A's
    _refused(out, x, [(0, 21, a, b, 1.0)])  # past the row
    _refused(out, x, [(5, 4, a, b, 1.0)])
    _refused(out, x, [(0, 10, a, b, 1.0), (9, 12, a, b, 1.0)])  # overlapping runs
    _refused(out, out.view(-1)[: 20 * 16].view(20, 16), runs)  # x is part of out

    class Sharded(torch.Tensor):  # as a DTensor: a subclass whose storage is not the tensor
        pass

    _refused(out.as_subclass(Sharded), x, runs)
    _refused(out, x, [(0, 10, a.as_subclass(Sharded), b, 1.0)])


def test_a_rank_above_the_limit_is_refused():
    rank = segments.MAX_RANK + 1
    out, x, runs = _problem(4, 8, 8, [(0, 2, 4), (2, 4, rank)])
    _refused(out, x, runs)


def test_autograd_recording_is_refused():
    out, x, runs = _problem(6, 8, 8, [(0, 6, 4)])
    _, _, a, b, scale = runs[0]
    grad_a = a.clone().requires_grad_()
    _refused(out, x, [(0, 6, grad_a, b, scale)])
    _refused(out, x.clone().requires_grad_(), runs)
    if segments.library() is not None:
        with torch.no_grad():  # nothing recorded: it runs
            assert segments.add_segments(out, x, [(0, 6, grad_a, b, scale)])


def test_without_native_in_the_chain_or_the_library_it_is_refused(monkeypatch):
    out, x, runs = _problem(6, 8, 8, [(0, 6, 4)])
    with registry.call_chains({segments.OP: ("torch",)}):
        _refused(out, x, runs)
    monkeypatch.setattr(segments, "library", lambda: None)  # as a machine without a compiler
    registry.forget()
    try:
        _refused(out, x, runs)
    finally:
        monkeypatch.undo()
        registry.forget()
