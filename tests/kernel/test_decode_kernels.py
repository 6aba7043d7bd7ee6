"""The decoding kernels (``kernel/gemv.c``, ``kernel/decode_step.c``) against float64 references and
torch's own ops, the same bits on any thread count, and the calls they refuse.

Tolerances: each output is an fp32 sum of at most a few hundred products in another order than
the reference's; 2e-4 absolute on sums of size ~25 (576 unit normal products) is a few hundred
fp32 roundings, far above what reordering costs on any SIMD width and far below a wrong term."""

import pytest
import torch
import torch.nn.functional as F
from thread_counts import on_threads

from twinkle.kernel import decode_step, gemv, switched

pytestmark = pytest.mark.skipif(
    gemv.library() is None or decode_step.library() is None, reason="no C compiler here"
)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize(("n", "k"), [(577, 576), (192, 70), (5, 3)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_equals_the_product_on_any_thread_count(rows, n, k, with_bias):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    want = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    one = on_threads(1, lambda: gemv.native(x, w, bias))
    two = on_threads(2, lambda: gemv.native(x, w, bias))
    torch.testing.assert_close(one, want.float(), rtol=0, atol=2e-4)
    assert torch.equal(one, two)  # each output is one thread's sum in a fixed order


def test_gemv_refuses_what_it_does_not_compute():
    w = torch.randn(16, 8)
    assert gemv.takes(torch.randn(8, 8), w)
    assert not gemv.takes(torch.randn(9, 8), w)  # more rows than the kernel's limit
    assert not gemv.takes(torch.randn(2, 8).double(), w.double())
    assert not gemv.takes(torch.randn(8, 2).t(), w)  # not contiguous
    assert not gemv.takes(torch.randn(2, 8, requires_grad=True), w)  # autograd would record it
    with torch.no_grad():
        assert gemv.takes(torch.randn(2, 8, requires_grad=True), w)
    with switched({"TWINKLE_NATIVE_GEMV": "off"}):
        assert not gemv.takes(torch.randn(2, 8), w)
        x = torch.randn(2, 8)
        torch.testing.assert_close(gemv.few_rows(x, w, None), x @ w.t())  # the library's product


def test_add_rms_norm_and_silu_mul_equal_the_torch_ops():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(0)
    norm = LlamaRMSNorm(576, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=g))
    hidden, add = torch.randn(3, 576, generator=g), torch.randn(3, 576, generator=g)
    want_hidden = hidden + add
    with torch.no_grad():
        want = norm(want_hidden)
    out = torch.empty_like(hidden)
    decode_step.add_rms_norm(hidden, add, norm.weight.detach(), norm.variance_epsilon, out)
    torch.testing.assert_close(hidden, want_hidden, rtol=0, atol=0)  # the residual added in place
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    gate, up = torch.randn(3, 1536, generator=g) * 4, torch.randn(3, 1536, generator=g)
    want = F.silu(gate) * up
    torch.testing.assert_close(decode_step.silu_mul(gate, up), want, rtol=1e-5, atol=1e-6)


def _reference(q, k, v, cos, sin, keys, values, length, mask, scale):
    """HF's rotation and SDPA over the cache with this position appended, in float64."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rows, kv_heads, _, dim = keys.shape
    q = q.double().view(rows, -1, 1, dim)
    k = k.double().view(rows, kv_heads, 1, dim)
    q, k = apply_rotary_pos_emb(q, k, cos.double()[:, None], sin.double()[:, None])
    keys = torch.cat([keys[:, :, :length].double(), k], dim=2)
    values = torch.cat([values[:, :, :length].double(), v.double().view(rows, kv_heads, 1, dim)], dim=2)
    attn_mask = None if mask is None else mask.bool()[:, None, None, :]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask, scale=scale, enable_gqa=True)
    return out.reshape(rows, -1), k, values[:, :, -1:]


@pytest.mark.parametrize("masked", [False, True])
def test_decode_attention_equals_rotation_then_sdpa(masked):
    g = torch.Generator().manual_seed(1)
    rows, heads, kv_heads, dim, length, capacity = 3, 6, 2, 16, 9, 12
    q = torch.randn(rows, heads * dim, generator=g)
    k, v = (torch.randn(rows, kv_heads * dim, generator=g) for _ in range(2))
    angles = torch.randn(rows, dim // 2, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    keys, values = (torch.randn(rows, kv_heads, capacity, dim, generator=g) for _ in range(2))
    mask = None
    if masked:  # row 1 has two left pads, row 2 one pad in the middle (a shared prefix's gap)
        mask = torch.ones(rows, length + 1, dtype=torch.long)
        mask[1, :2] = 0
        mask[2, 4] = 0
    want, rotated_k, new_v = _reference(q, k, v, cos, sin, keys, values, length, mask, 0.25)
    before = keys.clone()
    outs = []
    for threads in (1, 2):
        kc, vc = keys.clone(), values.clone()
        outs.append(
            on_threads(
                threads,
                lambda kc=kc, vc=vc: decode_step.attention(q, k, v, cos, sin, kc, vc, length, mask, 0.25),
            )
        )
        torch.testing.assert_close(kc[:, :, length : length + 1].double(), rotated_k, rtol=0, atol=1e-5)
        torch.testing.assert_close(vc[:, :, length : length + 1].double(), new_v, rtol=0, atol=0)
        assert torch.equal(kc[:, :, :length], before[:, :, :length])  # earlier positions untouched
        assert torch.equal(kc[:, :, length + 1 :], before[:, :, length + 1 :])
    torch.testing.assert_close(outs[0].double(), want, rtol=0, atol=1e-5)
    assert torch.equal(outs[0], outs[1])


def test_a_decoding_kernel_that_cannot_be_built_is_none_with_one_warning(monkeypatch, caplog):
    """Without a compiler the kernel's loader gives None (its backend is then unavailable and
    the chain goes on to ``torch``), with one warning that says why."""
    import logging

    from twinkle.kernel import native_build

    monkeypatch.setattr(native_build.shutil, "which", lambda name: None)
    library = native_build.lazy(gemv._load, "native decoding products")
    with caplog.at_level(logging.WARNING, logger="twinkle"):
        assert library() is None and library() is None
    warnings = [r.getMessage() for r in caplog.records if "native decoding products" in r.getMessage()]
    assert len(warnings) == 1 and "no C compiler" in warnings[0]
