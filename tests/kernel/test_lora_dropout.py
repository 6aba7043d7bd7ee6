"""LoRA dropout inside the fused nodes: PEFT's semantics (Bernoulli(1-p) on the branch's input,
scaled by 1/(1-p), training mode only), masks from a seed drawn from torch's generator and
recomputed in backward, nothing kept for them."""

import copy

import pytest
import torch
from masks import record, replay
from peft import LoraConfig, get_peft_model
from tiny import TINY_LLAMA_SHAPE
from tolerances import assert_within, chain_tolerances, gamma, matmul_bound, tiny_llama_sums
from transformers import LlamaConfig, LlamaForCausalLM

from twinkle.kernel import KernelChoice, kernelize
from twinkle.kernel.lora import dropout
from twinkle.kernel.lora.linear import fuse_lora_linears


@pytest.mark.parametrize("p", [0.05, 0.1, 0.5])
def test_the_rate_and_the_scale(p):
    x = torch.randn(2048, 2048)  # 4M elements: the rate's standard deviation is under 2.5e-4
    torch.manual_seed(0)
    for _ in range(3):
        drop = dropout.draw(p)
        out = dropout.apply(x, drop)
        kept = out != 0
        assert abs((1 - kept.float().mean().item()) - p) < 2e-3  # more than 8 standard deviations
        scale = torch.tensor(1.0) / torch.tensor(1 - p)  # nn.Dropout's factor, in fp32
        assert torch.equal(out[kept], x[kept] * scale)


def test_the_kernel_and_the_torch_ops_give_the_same_mask(monkeypatch):
    x = torch.randn(300, 577)
    drop = dropout.draw(0.3)
    assert dropout._library() is not None  # this machine has a compiler: the kernel runs
    ours = dropout.apply(x, drop)
    expected = x * torch.where(dropout.keep_mask(x.shape, drop), drop.scale(torch.float32), 0)
    assert torch.equal(ours, expected)
    monkeypatch.setitem(dropout._state, "lib", None)  # no compiler: torch ops
    assert torch.equal(dropout.apply(x, drop), ours)
    monkeypatch.undo()
    # the mask follows the elements' logical order, whatever the memory layout
    assert torch.equal(dropout.apply(x.t(), drop), dropout.apply(x.t().contiguous(), drop))


def test_the_mask_depends_on_the_seed_only():
    x = torch.randn(512, 512)
    drop = dropout.draw(0.2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = dropout.apply(x, drop)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(dropout.apply(x, drop), one)
    a, b = dropout.keep_mask(x.shape, drop), dropout.keep_mask(x.shape, dropout.draw(0.2))
    both_dropped = (~a & ~b).float().mean().item()
    assert abs(both_dropped - 0.2 * 0.2) < 5e-3  # independent masks: p^2 (std 4e-4)


def test_the_seeds_follow_torch_manual_seed():
    torch.manual_seed(5)
    first = [dropout.draw(0.1) for _ in range(3)]
    torch.manual_seed(5)
    assert [dropout.draw(0.1) for _ in range(3)] == first
    assert len({d.seed for d in first}) == 3


def test_nan_stays_nan_where_dropped_as_in_nn_dropout():
    x = torch.full((64, 64), float("nan"))
    assert torch.isnan(dropout.apply(x, dropout.draw(0.5))).all()


def _models(p: float):
    """A tiny LoRA Llama twice: PEFT's own forward, and kernelized into the fused nodes."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**dict(TINY_LLAMA_SHAPE, vocab_size=100)))
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=p, init_lora_weights=False
    )
    peft_model = get_peft_model(model, config)
    fused = copy.deepcopy(peft_model)
    fuse_lora_linears(fused)
    mapping = {
        "LlamaAttention": KernelChoice("lora_attention", ("torch",)),
        "LlamaMLP": KernelChoice("swiglu_mlp", ("torch",)),
    }
    return peft_model.train(), kernelize(fused, mapping).train()


def _loss_and_grads(model, ids):
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_a_model_gives_peft_gradients_given_the_same_masks(monkeypatch):
    peft_model, fused = _models(0.3)
    ids = torch.randint(0, 100, (2, 13))
    drawn = record(monkeypatch)
    loss, grads = _loss_and_grads(fused, ids)
    assert len(drawn) == 7 * TINY_LLAMA_SHAPE["num_hidden_layers"]  # q k v o gate up down
    queue = replay(peft_model, drawn)
    loss_ref, grads_ref = _loss_and_grads(peft_model, ids)
    assert not queue
    assert grads.keys() == grads_ref.keys() and len(grads) == 14 * TINY_LLAMA_SHAPE["num_hidden_layers"]
    _assert_same_loss_and_grads(loss, grads, loss_ref, grads_ref, ids.shape[1])


def _assert_same_loss_and_grads(loss, grads, loss_ref, grads_ref, tokens):
    """The fused nodes and PEFT sum the same terms in other orders: within the first-order bound
    of the tiny Llama's chain of fp32 sums (tolerances.py, ~7e-5 relative to each tensor's
    scale); a mask applied to the wrong adapter moves the gradients by ~10% of their scale."""
    sums = tiny_llama_sums(tokens)
    torch.testing.assert_close(loss, loss_ref, **chain_tolerances(sums, loss_ref))
    for name, grad in grads_ref.items():
        torch.testing.assert_close(grads[name], grad, **chain_tolerances(sums, grad), msg=name)


def test_nodes_with_some_adapters_unmasked_give_peft_gradients(monkeypatch):
    """k's and up's adapters without dropout: the q/k/v and MLP nodes mask the others one by one."""
    peft_model, fused = _models(0.3)
    for model in (peft_model, fused):
        for name, module in model.named_modules():
            if name.endswith(("k_proj", "up_proj")) and hasattr(module, "lora_dropout"):
                module.lora_dropout["default"] = torch.nn.Identity()
    ids = torch.randint(0, 100, (2, 13))
    drawn = record(monkeypatch)
    loss, grads = _loss_and_grads(fused, ids)
    assert len(drawn) == 5 * TINY_LLAMA_SHAPE["num_hidden_layers"]
    queue = replay(peft_model, drawn)
    loss_ref, grads_ref = _loss_and_grads(peft_model, ids)
    assert not queue
    _assert_same_loss_and_grads(loss, grads, loss_ref, grads_ref, ids.shape[1])


def test_eval_mode_draws_nothing(monkeypatch):
    peft_model, fused = _models(0.3)
    fused.eval()
    drawn = record(monkeypatch)
    ids = torch.randint(0, 100, (1, 9))
    state = torch.get_rng_state()
    with torch.no_grad():
        out = fused(input_ids=ids, use_cache=False).logits
    assert not drawn and torch.equal(torch.get_rng_state(), state)
    with torch.no_grad():
        expected = peft_model.eval()(input_ids=ids, use_cache=False).logits
    # the forward's chain of fp32 sums, in other orders (tolerances.py)
    torch.testing.assert_close(out, expected, **chain_tolerances(tiny_llama_sums(ids.shape[1]), expected))


def _saved_bytes(model, ids) -> int:
    """Bytes autograd keeps for backward over one forward."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, use_cache=False).logits.sum().backward()
    return total


def test_the_nodes_keep_their_masks_as_bits_only():
    ids = torch.randint(0, 100, (2, 64))
    _, without = _models(0.0)
    peft_model, with_dropout = _models(0.1)
    shape = TINY_LLAMA_SHAPE
    tokens, words = ids.numel(), lambda width: -(-width // 16)
    # a 16-bit word per 16 elements of each masked input: q, k, v, o, gate and up read hidden-wide
    # inputs, down an intermediate-wide one
    bits = (
        shape["num_hidden_layers"]
        * tokens
        * 2
        * (6 * words(shape["hidden_size"]) + words(shape["intermediate_size"]))
    )
    assert _saved_bytes(with_dropout, ids) == _saved_bytes(without, ids) + bits
    masked_inputs = (
        shape["num_hidden_layers"] * tokens * 4 * (6 * shape["hidden_size"] + shape["intermediate_size"])
    )
    assert bits * 32 == masked_inputs  # 1/32 of the fp32 inputs the masks cover
    assert _saved_bytes(peft_model, ids) > _saved_bytes(with_dropout, ids)


def test_without_the_kernel_the_nodes_keep_nothing_for_their_masks(monkeypatch):
    monkeypatch.setitem(dropout._state, "lib", None)
    ids = torch.randint(0, 100, (2, 64))
    _, without = _models(0.0)
    _, with_dropout = _models(0.1)
    assert _saved_bytes(with_dropout, ids) == _saved_bytes(without, ids)  # recomputed from seeds


def test_a_built_kernel_that_disagrees_with_the_torch_ops_is_not_used(monkeypatch, caplog):
    real = dropout._library()

    class OtherSeed:  # as a miscompiled build: a valid mask, but not the one the seed names
        twinkle_lora_masked_down_f32 = real.twinkle_lora_masked_down_f32
        twinkle_lora_masked_up_grad_f32 = real.twinkle_lora_masked_up_grad_f32

        @staticmethod
        def twinkle_dropout_f32(x, out, n, seed, drop_below, scale, threads):
            real.twinkle_dropout_f32(x, out, n, seed ^ 1, drop_below, scale, threads)

    monkeypatch.setattr(dropout, "load_library", lambda source: OtherSeed)
    monkeypatch.setattr(dropout, "_state", {})
    with caplog.at_level("WARNING", logger="twinkle"):
        assert dropout._library() is None
    assert any("masks are computed with torch ops" in r.getMessage() for r in caplog.records)
    x = torch.randn(64, 64)
    drop = dropout.draw(0.5)
    assert torch.equal(dropout.apply(x, drop) != 0, dropout.keep_mask(x.shape, drop))


@pytest.mark.parametrize(
    "tokens, hidden, rank, adapters",
    [(37, 100, 8, 1), (5, 1536, 4, 1), (64, 576, 8, 3), (71, 200, 20, 2), (3, 7, 1, 1), (9, 40, 3, 3)],
)
def test_the_fused_masked_products_equal_the_torch_ops(tokens, hidden, rank, adapters, monkeypatch):
    torch.manual_seed(0)
    x, a = torch.randn(tokens, hidden), torch.randn(adapters * rank, hidden)  # the A matrices stacked
    g_low = torch.randn(adapters * rank, tokens).t()  # (tokens, n r) with the nodes' strides
    base = torch.randn(tokens, hidden)
    drops = tuple(dropout.draw(0.3) for _ in range(adapters))
    assert dropout._library() is not None

    def run(use_bits=True):
        low, bits = dropout.masked_low(x, a, drops)
        if dropout._state["lib"] is not None:
            assert bits is not None and bits.shape == (adapters, tokens, -(-hidden // 16))
        grad_x = base.clone()
        grad_a = dropout.masked_input_grads(x, a, g_low, drops, grad_x, True, bits if use_bits else None)
        return low, grad_a, grad_x

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        two = run()
    finally:
        torch.set_num_threads(threads)
    for a_, b_ in zip(one, two, strict=True):
        assert torch.equal(a_, b_)  # the same sums whatever the thread count
    for a_, b_ in zip(one, run(use_bits=False), strict=True):
        assert torch.equal(a_, b_)  # the kept bits are the masks the seeds give
    monkeypatch.setitem(dropout._state, "lib", None)
    expected = run()  # torch ops on the masked copies
    # Both against float64, each element within the worst error of its own fp32 sums in any order
    # (tolerances.py): low sums `hidden` products of a scaled input (one more rounding), A's
    # gradient `tokens` of them; x's gradient adds each adapter's r-term product, scaled, to
    # `base`. A wrong mask or a missing term moves an element by about one term, ~1; the bounds
    # are ~gamma(hidden) * sum|terms|, under 3e-2 here.
    refs, bounds = _float64_products(x, a, g_low, base, drops)
    for what, got, want, ref, bound in zip(
        ("low", "grad_a", "grad_x"), one, expected, refs, bounds, strict=True
    ):
        assert_within(got, ref, bound, f"kernel {what}")
        assert_within(want, ref, bound, f"torch {what}")
    # each adapter alone gives its own slice: the stacked call is n single ones
    for i, drop in enumerate(drops):
        rows = slice(i * rank, (i + 1) * rank)
        single_low = dropout.masked_low(x, a[rows], (drop,))[0]
        assert_within(single_low, refs[0][:, rows], bounds[0][:, rows], f"adapter {i}'s low")
        single_a = dropout.masked_input_grads(x, a[rows], g_low[:, rows], (drop,), None, True)
        assert_within(single_a, refs[1][rows], bounds[1][rows], f"adapter {i}'s grad_a")


def _float64_products(x, a, g_low, base, drops):
    """``masked_low``'s and ``masked_input_grads``' results in float64 from the same masks and
    fp32 scales, and the elementwise worst error of computing each in fp32."""
    rank = a.shape[0] // len(drops)
    x64, a64, g64 = x.double(), a.double(), g_low.double()
    low, grad_a, bound_low, bound_a = [], [], [], []
    grad_x, magnitude_x = base.double().clone(), base.double().abs()
    for i, drop in enumerate(drops):
        rows = slice(i * rank, (i + 1) * rank)
        factor = dropout.keep_mask(x.shape, drop).double() * float(drop.scale(torch.float32))
        masked = x64 * factor
        low.append(masked @ a64[rows].t())
        bound_low.append(matmul_bound(masked, a64[rows].t(), extra=1))
        grad_a.append(g64[:, rows].t() @ masked)
        bound_a.append(matmul_bound(g64[:, rows].t(), masked, extra=1))
        grad_x += (g64[:, rows] @ a64[rows]) * factor
        magnitude_x += (g64[:, rows].abs() @ a64[rows].abs()) * factor
    # per term: r products summed, the scaling, then one addition per adapter onto `base`
    bound_x = gamma(len(drops) * (rank + 1) + 2) * magnitude_x
    return (torch.cat(low, 1), torch.cat(grad_a), grad_x), (
        torch.cat(bound_low, 1),
        torch.cat(bound_a),
        bound_x,
    )


@pytest.mark.parametrize("hidden", [48, 50])
def test_the_kept_bits_are_the_mask(hidden):
    x, a = torch.randn(5, hidden), torch.randn(8, hidden)
    drops = (dropout.draw(0.4), dropout.draw(0.4))
    _, bits = dropout.masked_low(x, a, drops)
    words = bits.to(torch.int32) & 0xFFFF  # each int16 word as its 16 bits
    unpacked = (words.unsqueeze(-1) >> torch.arange(16)) & 1  # (adapters, tokens, words, 16)
    flat = unpacked.reshape(2, 5, -1).bool()
    for i, drop in enumerate(drops):
        assert torch.equal(flat[i, :, :hidden], dropout.keep_mask(x.shape, drop))
    assert not flat[:, :, hidden:].any()  # the last word's padding is zero
