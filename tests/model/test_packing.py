"""Padding-free batches give the loss and gradients of the padded batch."""

import pytest
import torch
import torch.nn.functional as F
from batches import padded_batches
from tolerances import attention_sums, chain_tolerances, rounding_tolerances, tiny_batch_sums

import twinkle.model.packing as packing
from twinkle.kernel import set_switches
from twinkle.kernel.attention.packed import Segments, segment_attention
from twinkle.model.packing import pack

IGNORE = -100


def _loss_and_grads(make_model, batch, padding_free: bool):
    model = make_model(init_lora_weights=False)
    model.padding_free = padding_free
    loss = model.forward_backward(inputs=batch)
    grads = {n: p.grad.clone() for n, p in model.model.named_parameters() if p.grad is not None}
    return loss, grads


@pytest.mark.parametrize("share_prefix", [True, False])
@pytest.mark.parametrize("choice", ["off", "always"])  # flash calls per sample, batched products
def test_packed_equals_padded(make_model, dataset, monkeypatch, share_prefix, choice):
    set_switches({"TWINKLE_BATCHED_ATTENTION": choice})
    batch = next(iter(padded_batches(dataset, batch_size=4)))
    lengths = batch["attention_mask"].sum(1)
    assert lengths.min() < lengths.max()  # the batch really has padding
    layout = pack(batch)["twinkle_segments"]
    assert layout.prefix >= packing.MIN_SHARED_PREFIX  # the chat markup every row starts with
    if not share_prefix:
        monkeypatch.setattr(packing, "MIN_SHARED_PREFIX", 10**6)
        assert pack(batch)["twinkle_segments"].prefix == 0
    loss_padded, grads_padded = _loss_and_grads(make_model, batch, padding_free=False)
    loss_packed, grads_packed = _loss_and_grads(make_model, batch, padding_free=True)
    _assert_same_loss_and_grads((loss_packed, grads_packed), (loss_padded, grads_padded), batch)


def test_a_scored_shared_prefix_runs_once_and_is_scored_for_every_sample(make_model, dataset):
    """Every position labelled (as a Tinker datum is): the shared prefix still runs once, and
    its positions are scored for each sample, in the padded batch's row-major order: the loss,
    the gradients and each label's log-probability equal the padded batch's."""
    batch = next(iter(padded_batches(dataset, batch_size=4)))
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE)
    batch["labels"] = labels.clone()
    batch["labels"][:, 0] = IGNORE
    packed = pack(batch)
    assert packed["twinkle_segments"].prefix >= packing.MIN_SHARED_PREFIX and packed["gather"] is not None
    assert packed["gather"].numel() == int(
        (packing.shifted_targets(batch["labels"], batch["attention_mask"]) != IGNORE).sum()
    )
    results = [_loss_and_grads(make_model, batch, padding_free=free) for free in (True, False)]
    _assert_same_loss_and_grads(*results, batch)
    logps = []
    for free in (True, False):
        model = make_model(init_lora_weights=False)
        model.padding_free = free
        logps.append(model.forward_only(inputs=batch)["logps"])
    sums = tiny_batch_sums(batch["input_ids"])
    torch.testing.assert_close(logps[0], logps[1], **chain_tolerances(sums, logps[1]))


def _assert_same_loss_and_grads(actual, expected, batch):
    """fp32 with other matmul shapes: the same terms summed in other orders, within the
    first-order bound of the tiny model's chain of sums over this batch (tolerances.py: ~2e-4
    relative to each tensor's scale). A sample attending across its boundary, a padding token
    scored or a prefix counted twice moves the loss and gradients by a few percent or more."""
    sums = tiny_batch_sums(batch["input_ids"])
    loss, loss_ref = torch.tensor(actual[0]), torch.tensor(expected[0])
    torch.testing.assert_close(loss, loss_ref, **chain_tolerances(sums, loss_ref))
    grads, grads_ref = actual[1], expected[1]
    assert grads_ref.keys() == grads.keys() and grads_ref
    for name, grad in grads_ref.items():
        torch.testing.assert_close(grads[name], grad, **chain_tolerances(sums, grad), msg=name)


def _batch(rows: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
    """Right-padded batch of (input_ids, labels) rows."""
    width = max(len(ids) for ids, _ in rows)
    out = {"input_ids": [], "labels": [], "attention_mask": [], "position_ids": []}
    for ids, labels in rows:
        pad = width - len(ids)
        out["input_ids"].append(ids + [0] * pad)
        out["labels"].append(labels + [IGNORE] * pad)
        out["attention_mask"].append([1] * len(ids) + [0] * pad)
        out["position_ids"].append(list(range(len(ids))) + [0] * pad)
    return {k: torch.tensor(v) for k, v in out.items()}


def test_pack_layout_shares_the_prefix_and_drops_unscored_tails():
    x = IGNORE
    batch = _batch(
        [
            ([1, 2, 3, 4, 5, 6, 7, 8], [x, x, x, x, x, 6, 7, x]),  # last token scores nothing
            ([1, 2, 3, 4, 5, 9], [x, x, x, x, x, 9]),
            ([1, 2, 3, 4, 7, 7, 7], [x, x, x, x, x, x, x]),  # no target: the row drops out
        ]
    )
    packed = pack(batch)
    # Row 0 keeps positions 0..5 (position 5 predicts 7), row 1 positions 0..4. Both start with
    # [1, 2, 3, 4, 5], but position 4 has a target (6 and 9): only [1, 2, 3, 4] is shared.
    assert packed["twinkle_segments"] == Segments(spans=((4, 6), (6, 7)), prefix=4)
    assert packed["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 5]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 4]]
    assert packed["targets"].tolist() == [[x, x, x, x, 6, 7, 9]]
    assert packed["attention_mask"].tolist() == [[1] * 7]


def test_pack_with_keys_holds_each_groups_prefix_before_its_samples():
    x = IGNORE
    batch = _batch(
        [
            ([1, 2, 3, 4, 5, 6], [x, x, x, x, x, 6]),
            ([1, 2, 3, 4, 5, 8, 9], [x, x, x, x, x, 8, 9]),
            ([1, 2, 3, 4, 5, 7], [x, x, x, x, x, 7]),  # the same prefix, another key: not shared
            ([1, 2, 3, 4, 5, 9], [x, x, x, x, x, 9]),
            ([3, 3, 2], [x, 3, 2]),  # a key of its own: no prefix
        ]
    )
    packed = pack(batch, share_prefix=["a", "a", "b", "b", "c"])
    # a: prefix [1..4] (position 4 predicts a target), then 5 | 5 8; b: the same; c: whole
    assert packed["twinkle_segments"] == Segments(
        spans=((4, 5), (5, 7), (11, 12), (12, 13), (13, 15)),
        prefix=0,
        blocks=((0, 4, 2), (7, 4, 2), (13, 0, 1)),
    )
    assert packed["input_ids"].tolist() == [[1, 2, 3, 4, 5, 5, 8, 1, 2, 3, 4, 5, 5, 3, 3]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 4, 4, 5, 0, 1, 2, 3, 4, 4, 0, 1]]
    assert packed["targets"].tolist() == [[x, x, x, x, 6, 8, 9, x, x, x, x, 7, 9, 3, 2]]
    assert packed["gather"] is None
    one_key = pack(batch, share_prefix=["a"] * 5)  # one group: what all five share, nothing
    assert one_key["twinkle_segments"] == pack(batch, share_prefix=False)["twinkle_segments"]
    # by default the four rows that start alike hold their prefix once, the fifth goes whole
    assert pack(batch)["twinkle_segments"] == Segments(
        spans=((4, 5), (5, 7), (7, 8), (8, 9), (9, 11)), prefix=0, blocks=((0, 4, 4), (9, 0, 1))
    )


def test_pack_keeps_one_prefix_for_all_rows_unless_runs_of_rows_leave_out_more():
    x = IGNORE
    system = [1, 2, 3, 4]
    pair = [([*system, 5, 6, 7, 8, 9, r], [x] * 9 + [r]) for r in (10, 11)]  # one prompt, two replies
    other = [([*system, 7, 7, 7, 7, 7, r], [x] * 9 + [r]) for r in (12, 13)]
    blocks = pack(_batch(pair + other))["twinkle_segments"].blocks
    assert blocks == ((0, 8, 2), (10, 8, 2))  # each prompt once: 16 tokens left out, not 12
    alike = [([*system, 5 + i, 6, 7, 8, 9, 10], [x] * 9 + [10]) for i in range(4)]  # only the system
    segments = pack(_batch(alike))["twinkle_segments"]
    assert segments.prefix == 4 and segments.blocks == ()


def test_pack_with_keys_gathers_targets_of_each_groups_prefix():
    x = IGNORE
    rows = [[1, 2, 3, 4, 5, 6, last] for last in (7, 8, 9)]
    batch = _batch([(ids, [x, *ids[1:]]) for ids in rows])  # every position scored
    packed = pack(batch, share_prefix=["a", "a", "b"])
    assert packed["twinkle_segments"].blocks == ((0, 5, 2), (7, 0, 1))
    # each row's scored positions in row-major order: a's prefix twice, b's whole row once
    assert packed["gather"].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 6, *range(7, 13)]
    targets = packed["targets"][0, packed["gather"]].tolist()
    assert targets == [2, 3, 4, 5, 6, 7, 2, 3, 4, 5, 6, 8, 2, 3, 4, 5, 6, 9]


def test_pack_makes_every_tensor_on_the_batch_device():
    # On a GPU the batch is on the device while a factory call without device= lands on the CPU.
    # Here the batch is on the CPU and the default device is meta: any such call would fail.
    x = IGNORE
    batch = _batch([([1, 2, 3, 4, 5, 6, 7], [x, x, x, x, x, 6, 7]), ([1, 2, 3, 4, 5, 9], [x, x, x, x, x, 9])])
    expected = pack(batch)
    assert expected["twinkle_segments"].prefix == 4  # the prefix is shared: _common_prefix ran
    with torch.device("meta"):
        got = pack(batch)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def test_pack_without_a_shared_prefix_or_targets():
    x = IGNORE
    batch = _batch([([1, 2, 3], [x, 2, 3]), ([4, 5], [x, 5])])
    packed = pack(batch)
    assert packed["twinkle_segments"] == Segments(spans=((0, 2), (2, 3)), prefix=0)
    assert packed["input_ids"].tolist() == [[1, 2, 4]]
    assert packed["targets"].tolist() == [[2, 3, 5]]
    assert pack(_batch([([1, 2], [x, x])])) is None
    left_padded = _batch([([1, 2, 3], [x, 2, 3]), ([4, 5], [x, 5])])
    left_padded["attention_mask"][1] = torch.tensor([0, 1, 1])
    assert pack(left_padded) is None


def _reference(query, key, value, segments, window):
    """Attention with an explicit (T, T) mask built from sample ids and positions."""
    t = query.shape[2]
    owner = torch.full((t,), -1)
    pos = torch.arange(t)
    for i, (start, end) in enumerate(segments.spans):
        owner[start:end] = i
        pos[start:end] = torch.arange(segments.prefix, segments.prefix + end - start)
    same = (owner[:, None] == owner[None, :]) | (owner[None, :] == -1)
    allowed = same & (pos[None, :] <= pos[:, None])
    allowed &= (owner[:, None] == -1) <= (owner[None, :] == -1)  # the prefix sees only itself
    if window is not None:
        allowed &= pos[:, None] - pos[None, :] < window
    rep = query.shape[1] // key.shape[1]
    out = F.scaled_dot_product_attention(
        query, key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1), attn_mask=allowed
    )
    return out.transpose(1, 2)


@pytest.mark.parametrize("prefix", [0, 3])
@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("choice", ["off", "always"])  # flash calls per sample, batched products
def test_segment_attention_equals_a_masked_row(prefix, window, choice, monkeypatch):
    set_switches({"TWINKLE_BATCHED_ATTENTION": choice})
    torch.manual_seed(0)
    segments = Segments(
        spans=((prefix, prefix + 4), (prefix + 4, prefix + 5), (prefix + 5, prefix + 8)), prefix=prefix
    )
    t = segments.length
    query = torch.randn(1, 4, t, 8, requires_grad=True)
    key = torch.randn(1, 2, t, 8, requires_grad=True)
    value = torch.randn(1, 2, t, 8, requires_grad=True)
    out = segment_attention(query, key, value, segments, sliding_window=window)
    ref = _reference(query, key, value, segments, window)
    _assert_attention_close(out, ref, (query, key, value))


def _assert_attention_close(out, ref, leaves):
    """Per-sample or batched attention against one masked attention: the same terms in other
    orders (masked keys add exact zeros), within the first-order bound of an attention forward
    and backward (tolerances.attention_sums); a key of another sample, a future key or one past
    the window would add a whole softmax weight."""
    sums = attention_sums(out.shape[1], out.shape[-1], leaves[0].shape[1] // leaves[1].shape[1])
    torch.testing.assert_close(out, ref, **chain_tolerances(sums, ref))
    grads = torch.autograd.grad(out.square().sum(), leaves)
    ref_grads = torch.autograd.grad(ref.square().sum(), leaves)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, **chain_tolerances(sums + [1], r))


def test_long_sample_after_a_prefix_runs_causal_without_a_mask(monkeypatch):
    """Past one CPU key block a sample after the shared prefix takes the causal kernel (zero
    queries stand in for the prefix's); its output and gradients are the masked row's."""
    import twinkle.kernel.attention.sdpa as attention

    torch.manual_seed(0)
    prefix, long = 3, attention.CPU_KEY_BLOCK + 40
    segments = Segments(spans=((prefix, prefix + 7), (prefix + 7, prefix + 7 + long)), prefix=prefix)
    t = segments.length
    leaves = [torch.randn(1, heads, t, 8, requires_grad=True) for heads in (4, 2, 2)]
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kwargs):
        calls.append((q.shape[2], k.shape[2], attn_mask is None, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    out = segment_attention(*leaves, segments)
    # the prefix with the first sample (causal), then the long sample: square, causal, no mask
    assert calls == [(prefix + 7, prefix + 7, True, True), (prefix + long, prefix + long, True, True)]
    ref = _reference(*leaves, segments, None)
    _assert_attention_close(out, ref, leaves)


@pytest.mark.parametrize("prefix", [0, 3])
def test_bf16_segment_attention_runs_in_fp32_on_cpu(prefix):
    """bf16 on the CPU: the fp32 attention of the same inputs, rounded once (torch's bf16 CPU
    kernel is slower and rounds more), and gradients back in bf16."""
    torch.manual_seed(0)
    segments = Segments(spans=((prefix, prefix + 5), (prefix + 5, prefix + 9)), prefix=prefix)
    t = segments.length
    inputs = [torch.randn(1, heads, t, 16).to(torch.bfloat16) for heads in (4, 2, 2)]
    leaves = [x.clone().requires_grad_() for x in inputs]
    out = segment_attention(*leaves, segments)
    assert out.dtype == torch.bfloat16
    upcast = [x.float().requires_grad_() for x in inputs]
    expected = segment_attention(*upcast, segments)
    torch.testing.assert_close(out, expected.to(torch.bfloat16), rtol=0, atol=0)
    out.float().square().sum().backward()
    expected.to(torch.bfloat16).float().square().sum().backward()
    for leaf, ref in zip(leaves, upcast, strict=True):
        assert leaf.grad.dtype == torch.bfloat16
        # the same fp32 backward, rounded to bf16: once, and for the prefix each sample's share
        # and their bf16 sum (3 roundings; tolerances.rounding_tolerances, 2.3% of the scale,
        # room for shares larger than their sum); a gradient lost or doubled is off by its size
        tol = rounding_tolerances(3, ref.grad)
        torch.testing.assert_close(leaf.grad.float(), ref.grad, **tol)


def test_padded_forward_is_unchanged_after_packing(make_model, dataset):
    """The wrapped attention is the model's own without segments (evaluation, generation)."""
    model = make_model(init_lora_weights=False)
    batch = next(iter(padded_batches(dataset, batch_size=4)))
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    before = model.model(**inputs).logits
    name = model.model.config._attn_implementation
    model.forward_backward(inputs=batch)
    assert model.model.config._attn_implementation != name  # packing wrapped it
    after = model.model(**inputs).logits
    keep = batch["attention_mask"].bool()
    torch.testing.assert_close(after[keep], before[keep], rtol=0, atol=0)  # the same computation


def test_bottom_right_causal_bias_is_the_prefix_mask():
    """On CUDA a sample after a shared prefix attends with ``causal_lower_right`` (no mask tensor,
    so flash attention takes it); it must be the mask the other devices build."""
    from torch.nn.attention.bias import causal_lower_right

    from twinkle.kernel.attention.sdpa import window_mask as _window_mask

    queries, keys = 5, 9  # 4 prefix keys, then the sample's own 5
    positions = torch.arange(keys)
    mask = _window_mask(positions[keys - queries :], positions, None)
    assert torch.equal(causal_lower_right(queries, keys)._materialize(torch.device("cpu")), mask)
    q, k, v = torch.randn(1, 4, queries, 8), torch.randn(1, 2, keys, 8), torch.randn(1, 2, keys, 8)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    actual = F.scaled_dot_product_attention(
        q, k, v, attn_mask=causal_lower_right(queries, keys), enable_gqa=True
    )
    # torch's causal path against its masked one: other orders of the same terms; a wrong mask
    # moves an output by a whole softmax weight
    torch.testing.assert_close(actual, expected, **chain_tolerances(attention_sums(keys, 8, 2), expected))


@pytest.mark.parametrize("choice", ["off", "always"])
def test_attention_lora_node_on_a_packed_batch(make_model, dataset, monkeypatch, choice):
    """Kernelized attention (q/k/v and rotary as one LoRA node) gives the packed batch's loss and
    gradients of the layers run one by one, with either packed attention path."""
    from twinkle.kernel import kernelize
    from twinkle.kernel.lora import qkv as lora_qkv

    set_switches({"TWINKLE_BATCHED_ATTENTION": choice})
    batch = next(iter(padded_batches(dataset, batch_size=4)))
    calls = []
    real = lora_qkv._LoraQKV.apply
    monkeypatch.setattr(lora_qkv._LoraQKV, "apply", lambda *a: calls.append(1) or real(*a))
    results = {}
    for use in (False, True):
        set_switches({"TWINKLE_LORA_QKV": "on" if use else "off"})
        kernelized = kernelize(make_model(init_lora_weights=False))
        results[use] = _loss_and_grads(lambda init_lora_weights, m=kernelized: m, batch, padding_free=True)
        assert bool(calls) == use  # the node ran only where switched on
    _assert_same_loss_and_grads(results[True], results[False], batch)
