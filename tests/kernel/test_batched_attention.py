"""Short rows' attention as batched products: the per-sample flash calls' results."""

import pytest
import torch
from tolerances import attention_sums, chain_tolerances

from twinkle.kernel import set_switches
from twinkle.kernel.attention import batched as batched_attention
from twinkle.kernel.attention.packed import Segments, segment_attention


def _row(prefix: int, lengths: list[int], heads=(6, 2), dim=8, dtype=torch.float32):
    spans, start = [], prefix
    for n in lengths:
        spans.append((start, start + n))
        start += n
    # as the model hands them over: (1, T, heads, D) transposed
    leaves = [
        torch.randn(1, start, h, dim, dtype=dtype).transpose(1, 2).requires_grad_()
        for h in (heads[0], heads[1], heads[1])
    ]
    return Segments(tuple(spans), prefix), leaves


def _run(segments, leaves, choice, monkeypatch, **kwargs):
    set_switches({"TWINKLE_BATCHED_ATTENTION": choice})
    out = segment_attention(*leaves, segments, **kwargs)
    grads = torch.autograd.grad(out.square().sum(), [t for t in leaves if t.requires_grad])
    return [out, *grads]


def _assert_same(a, b, leaves) -> None:
    """The same terms summed in other orders (padded blocks, batched products): within the bound
    of attention's chain of fp32 sums (tolerances.attention_sums); the gradient of out^2 adds one
    more product. A query that sees another sample is off by ~1e-1 of the scale."""
    query, key = leaves[0], leaves[1]
    sums = attention_sums(query.shape[2], query.shape[3], query.shape[1] // key.shape[1]) + [2]
    torch.testing.assert_close(a, b, **chain_tolerances(sums, b))


def _spy_batched(monkeypatch) -> list:
    calls = []
    apply = batched_attention._BatchedAttention.apply

    def spy(*args):
        calls.append(args[3])  # the plan
        return apply(*args)

    monkeypatch.setattr(batched_attention._BatchedAttention, "apply", spy)
    return calls


@pytest.mark.parametrize(
    "prefix, lengths, heads",
    [
        (3, [5, 12, 1, 7], (6, 2)),  # a one-token sample: most of its block is padding
        (0, [4, 9, 9], (6, 2)),
        (5, [2, 20], (4, 4)),  # no grouped heads; the prefix rides with the short sample
        (0, [11], (3, 1)),
    ],
)
def test_batched_equals_the_per_sample_calls(prefix, lengths, heads, monkeypatch):
    torch.manual_seed(0)
    segments, leaves = _row(prefix, lengths, heads)
    calls = _spy_batched(monkeypatch)
    plain = _run(segments, leaves, "off", monkeypatch)
    assert not calls
    batched = _run(segments, leaves, "always", monkeypatch)
    assert len(calls) == 1
    for a, b in zip(batched, plain, strict=True):
        assert torch.isfinite(a).all()
        _assert_same(a, b, leaves)


def test_scaling_and_inputs_without_gradients(monkeypatch):
    torch.manual_seed(1)
    segments, leaves = _row(4, [6, 3, 8])
    leaves[1].requires_grad_(False)  # keys need none: query and value still get theirs
    plain = _run(segments, leaves, "off", monkeypatch, scaling=0.3)
    batched = _run(segments, leaves, "always", monkeypatch, scaling=0.3)
    assert len(batched) == 3
    for a, b in zip(batched, plain, strict=True):
        _assert_same(a, b, leaves)


def test_short_samples_share_a_block_and_the_prefix_rides_with_the_lightest():
    # samples of 7, 2 and 5 tokens after a 3-token prefix: blocks {7} and {5, 2}, the prefix's
    # queries in the first (10 x 10 scores, where a block each would be 3 x 7 x 10)
    assert batched_attention.layout([7, 2, 5], 3) == ([[0], [2, 1]], 0)
    plan = batched_attention.make_plan(((3, 10), (10, 12), (12, 17)), 3, 2, 1, torch.device("cpu"))
    assert (plan.blocks, plan.queries, plan.keys) == (2, 10, 10)
    assert plan.q_index.view(2, 10)[0].tolist() == list(range(10))
    assert plan.k_index.view(2, 10)[1].tolist() == [0, 1, 2, 12, 13, 14, 15, 16, 10, 11]
    # every row position has exactly one output slot, and it holds that position's query
    assert len(set(plan.out_index.tolist())) == 17
    assert (plan.q_index[plan.out_index] == torch.arange(17)).all()
    # block 1's query slot 5 is position 10 (sample 1's first token): the prefix and itself,
    # not sample 2's tokens beside it in the block
    seen = torch.isfinite(plan.bias.view(2, 1, 2, 10, 10)[1, 0, 0, 5])
    assert seen.tolist() == [True] * 3 + [False] * 5 + [True, False]


def test_the_cost_model_keeps_long_or_uneven_rows_on_the_flash_calls():
    def spans(prefix, lengths):
        out, start = [], prefix
        for n in lengths:
            out.append((start, start + n))
            start += n
        return tuple(out)

    assert batched_attention.pays(spans(14, [58, 31, 42, 31]), 14, 576)  # W1's rows
    assert batched_attention.pays(spans(14, [37, 28, 40, 26]), 14, 576)
    assert not batched_attention.pays(spans(14, [553, 706, 438, 779]), 14, 576)  # W2's
    assert not batched_attention.pays(spans(0, [153, 57]), 0, 576)  # mostly padding
    # wider heads make every pair dearer, so the fixed costs matter less
    assert not batched_attention.pays(spans(0, [120, 100, 130, 110]), 0, 14 * 64)


def test_blocks_longer_than_the_fitted_range_keep_the_flash_calls(monkeypatch):
    row = ((14, 72), (72, 103), (103, 145), (145, 176))  # W1's first row
    assert batched_attention.padded_size([58, 31, 42, 31], 14) == (4 * 58 * 72, 58)
    assert batched_attention.pays(row, 14, 576)
    monkeypatch.setattr(batched_attention, "MAX_QUERIES", 57)
    assert not batched_attention.pays(row, 14, 576)
    set_switches({"TWINKLE_BATCHED_ATTENTION": "always"})  # a forced choice is not capped
    assert batched_attention.pays(row, 14, 576)


def test_a_row_is_planned_once_for_all_its_layers(monkeypatch):
    torch.manual_seed(2)
    monkeypatch.setattr(batched_attention, "_plans", {})
    made = []
    make = batched_attention.make_plan
    monkeypatch.setattr(batched_attention, "make_plan", lambda *a: made.append(a) or make(*a))
    segments, leaves = _row(2, [5, 6])
    calls = _spy_batched(monkeypatch)
    for _ in range(3):  # three layers
        _run(segments, leaves, "always", monkeypatch)
    assert len(made) == 1 and len(calls) == 3 and calls[0] is calls[2]
    for n in range(batched_attention.PLANS_KEPT + 1):  # rows of new lengths: the cache stays small
        _run(*_row(2, [5, 6 + n]), "always", monkeypatch)
    assert len(batched_attention._plans) <= batched_attention.PLANS_KEPT


@pytest.mark.parametrize("case", ["dropout", "window"])
def test_dropout_or_a_window_keeps_the_flash_calls(case, monkeypatch):
    torch.manual_seed(3)
    segments, leaves = _row(0, [5, 6])
    calls = _spy_batched(monkeypatch)
    set_switches({"TWINKLE_BATCHED_ATTENTION": "always"})
    kwargs = {"dropout": 0.5} if case == "dropout" else {"sliding_window": 3}
    segment_attention(*leaves, segments, **kwargs)
    assert not calls


def test_bf16_runs_the_batched_products_in_fp32(monkeypatch):
    torch.manual_seed(4)
    segments, leaves = _row(3, [4, 7], dtype=torch.bfloat16)
    calls = _spy_batched(monkeypatch)
    set_switches({"TWINKLE_BATCHED_ATTENTION": "always"})
    out = segment_attention(*leaves, segments)
    assert out.dtype == torch.bfloat16 and len(calls) == 1
    out.float().sum().backward()
    assert all(t.grad.dtype == torch.bfloat16 for t in leaves)


@pytest.mark.parametrize("count", [1, 5, 300])
def test_layout_places_every_sample_once(count):
    lengths = torch.randint(1, 60, (count,), generator=torch.Generator().manual_seed(count)).tolist()
    blocks, carrier = batched_attention.layout(lengths, 7)
    assert sorted(i for block in blocks for i in block) == list(range(count))
    assert 0 <= carrier < len(blocks)
    padded, queries = batched_attention.padded_size(lengths, 7)
    loads = [sum(lengths[i] for i in block) for block in blocks]
    assert queries == max(max(loads), loads[carrier] + 7)
    # the padded scores cover every query's keys: its block's prefix and tokens
    assert padded >= sum(load * (7 + load) for load in loads)
