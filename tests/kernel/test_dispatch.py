"""One dispatch for every call op: each walks its chain from the registry's table, so editing the
table changes what runs (a test per op), and ``TWINKLE_KERNELS=none`` runs every op's plain
torch/PEFT backend: a tiny LoRA model's forward and backward then equal, bit for bit, those of
the same model never given to Twinkle's kernels."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from tiny import TINY_LLAMA_SHAPE
from transformers import LlamaConfig, LlamaForCausalLM

from twinkle.kernel import DEFAULT_CALL_CHAINS, call_chains, kernelize, registry, set_call_chains, switched
from twinkle.kernel import cpu_gemm as gemm
from twinkle.kernel.attention import batched, native, sdpa
from twinkle.kernel.attention.packed import Segments, segment_attention
from twinkle.kernel.kernelize import MARK
from twinkle.kernel.lora import dropout
from twinkle.kernel.lora import linear as lora_linear_mod
from twinkle.kernel.lora.linear import fuse_lora_linears
from twinkle.kernel.lora.mlp import lora_mlp
from twinkle.kernel.lora.qkv import lora_qkv
from twinkle.kernel.muon import BatchedMuon, muon_class
from twinkle.utils.errors import UserError

NONE = {"TWINKLE_KERNELS": "none"}


@pytest.fixture
def calls(monkeypatch):
    """``calls.spy(owner, name)`` counts the calls of ``owner.name`` (they still run) in
    ``calls.seen[name]``."""

    class Calls:
        seen: dict[str, int] = {}

        def spy(self, owner, name):
            real = getattr(owner, name)
            self.seen[name] = 0

            def counted(*args, **kwargs):
                self.seen[name] += 1
                return real(*args, **kwargs)

            monkeypatch.setattr(owner, name, counted)

    out = Calls()
    out.seen = {}
    return out


# ---------------------------------------------------------------------------- the table
def test_every_call_op_is_closed_by_its_one_plain_backend():
    for op, chain in DEFAULT_CALL_CHAINS.items():
        assert registry.plain_backend(op) == chain[-1], op
        assert set(registry.backends_of(op)) == set(chain), op  # every backend registered, none extra
        assert registry.table_chain(op) == chain


def test_a_bad_chain_is_one_line_and_changes_nothing():
    cases = {
        "cpu_gemm": (("onednn",), "must name each backend once and end with 'torch'"),
        "lora_mlp": (("modules", "fused"), "must name each backend once and end with 'modules'"),
        "muon_step": (("turbo", "torch"), "unknown backend 'turbo'; its backends: batched, torch"),
        "warp_drive": (("torch",), "unknown call op 'warp_drive'; call ops: packed_attention"),
    }
    for op, (chain, message) in cases.items():
        with pytest.raises(UserError, match=message):
            set_call_chains({"lora_linear": ("peft",), op: chain})  # checked before any is set
        assert registry.table_chain("lora_linear") == DEFAULT_CALL_CHAINS["lora_linear"]


def test_an_edited_table_that_cannot_run_is_refused_when_checked(monkeypatch):
    """The package checks the table once its backends registered (``check_call_chains``)."""
    registry.check_call_chains()
    monkeypatch.setitem(registry._CHAINS, "packed_attention", ("native", "sdpa", "batched"))
    with pytest.raises(UserError, match="must name each backend once and end with 'sdpa'"):
        registry.check_call_chains()


def test_set_and_reset_call_chains():
    try:
        set_call_chains({"muon_step": ("torch",)})
        assert muon_class(torch.optim.Muon) is torch.optim.Muon
    finally:
        registry.reset_call_chains()
    assert muon_class(torch.optim.Muon) is BatchedMuon


# ---------------------------------------------------------------------------- one test per op
def _row():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, 40, 16) for h in (4, 2, 2))
    return (q, k, v), Segments(((0, 12), (12, 40)))


def test_packed_attention_follows_its_chain(calls):
    for owner, name in ((native, "native_attention"), (batched, "batched_attention"), (sdpa, "per_sample")):
        calls.spy(owner, name)
    leaves, segments = _row()
    with switched({"TWINKLE_BATCHED_ATTENTION": "always", "TWINKLE_POOLED_ATTENTION": "off"}):
        with call_chains({"packed_attention": ("batched", "native", "sdpa")}):
            segment_attention(*leaves, segments)
        assert calls.seen == {"native_attention": 0, "batched_attention": 1, "per_sample": 0}
        with call_chains({"packed_attention": ("sdpa",)}):
            segment_attention(*leaves, segments)
        assert calls.seen == {"native_attention": 0, "batched_attention": 1, "per_sample": 1}
        segment_attention(*leaves, segments)  # the default table: native first where it runs
    native_ran = registry.enabled("packed_attention", "native")
    assert calls.seen["native_attention"] == int(native_ran)
    assert calls.seen["batched_attention"] == 1 + int(not native_ran)


def _lora_layer(p: float = 0.0):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6))
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["0"], lora_dropout=p, init_lora_weights=False)
    peft_model = get_peft_model(model, lora)
    assert fuse_lora_linears(peft_model) == 1
    return peft_model


def test_lora_linear_follows_its_chain(calls):
    calls.spy(lora_linear_mod, "lora_linear")
    model, x = _lora_layer(), torch.randn(3, 8)
    fused = model(x)
    assert calls.seen["lora_linear"] == 1
    with call_chains({"lora_linear": ("peft",)}):
        peft = model(x)
    assert calls.seen["lora_linear"] == 1  # PEFT's own forward
    torch.testing.assert_close(peft, fused)  # the same sums but two: a loose check of the routing


def _lora_llama(p: float = 0.0, seed: int = 0, fuse: bool = True):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA_SHAPE, vocab_size=100))
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=p, init_lora_weights=False)
    peft_model = get_peft_model(model, lora)
    if fuse:
        fuse_lora_linears(peft_model)
    return peft_model


def test_lora_mlp_and_lora_qkv_follow_their_chains():
    model = _lora_llama()
    layer = model.base_model.model.model.layers[0]
    x = torch.randn(1, 5, TINY_LLAMA_SHAPE["hidden_size"])
    head_dim = layer.self_attn.head_dim
    cos, sin = torch.ones(1, 5, head_dim), torch.zeros(1, 5, head_dim)
    assert lora_mlp(layer.mlp, x) is not None and lora_qkv(layer.self_attn, x, cos, sin) is not None
    with call_chains({"lora_mlp": ("modules",)}):
        assert lora_mlp(layer.mlp, x) is None  # the caller runs the layers
        assert lora_qkv(layer.self_attn, x, cos, sin) is not None
    with call_chains({"lora_qkv": ("modules",)}):
        assert lora_qkv(layer.self_attn, x, cos, sin) is None
        assert lora_mlp(layer.mlp, x) is not None


@pytest.fixture
def products(monkeypatch):
    """Each oneDNN call, as "packed" (from a packed copy) or "dense"."""
    seen: list[str] = []
    real = gemm._linear_pointwise

    def spy(x, w, bias):
        packed = any(w is entry[3] for entry in gemm._packed.values())
        seen.append("packed" if packed else "dense")
        return real(x, w, bias)

    monkeypatch.setattr(gemm, "_linear_pointwise", spy)
    return seen


@pytest.mark.skipif(not registry.is_available("cpu_gemm", "packed"), reason="torch built without oneDNN")
def test_cpu_gemm_follows_its_chain(fresh_gemm, products):
    x, w, g = torch.randn(5, 8), torch.randn(4, 8), torch.randn(5, 4)
    assert gemm.pack_frozen([w]) == w.nbytes
    with torch.no_grad():
        gemm.linear(x, w)
        gemm.times_weight(g, w)
    assert products == ["packed", "dense"]
    with call_chains({"cpu_gemm": ("onednn", "packed", "torch")}), torch.no_grad():
        gemm.linear(x, w)  # the dense weight first: the packed copy is never reached
    assert products[2:] == ["dense"]
    with call_chains({"cpu_gemm": ("packed", "torch")}), torch.no_grad():
        gemm.linear(x, w)
        assert torch.equal(gemm.times_weight(g, w), g @ w)  # no packed form: torch's
    assert products[3:] == ["packed"]
    with call_chains({"cpu_gemm": ("torch",)}), torch.no_grad():
        assert torch.equal(gemm.linear(x, w), x @ w.t())
        assert gemm.pack_frozen([torch.randn(4, 8)]) == 0  # and no new packed copies
    assert len(products) == 4


def test_muon_step_follows_its_chain():
    assert muon_class(torch.optim.Muon) is BatchedMuon
    with call_chains({"muon_step": ("torch",)}):
        assert muon_class(torch.optim.Muon) is torch.optim.Muon


def test_lora_dropout_follows_its_chain_with_the_same_masks(calls):
    x, a = torch.randn(30, 64), torch.randn(4, 64)
    drop = dropout.draw(0.25)
    native_low, native_bits = dropout.masked_low(x, a, (drop,))
    calls.spy(dropout, "keep_mask")
    with call_chains({"lora_dropout": ("torch",)}):
        masked = dropout.apply(x, drop)
        torch_low, torch_bits = dropout.masked_low(x, a, (drop,))
    assert calls.seen["keep_mask"] == 2 and torch_bits is None
    assert torch.equal(masked != 0, dropout.keep_mask(x.shape, drop))
    if native_bits is not None:  # the C kernel ran by default: the same masks, its own sums
        torch.testing.assert_close(native_low, torch_low)


# ---------------------------------------------------------------------------- TWINKLE_KERNELS
def test_kernels_none_leaves_every_call_op_its_plain_backend():
    with switched(NONE):
        for op in DEFAULT_CALL_CHAINS:
            assert registry.chain(op) == (registry.plain_backend(op),), op
        assert registry.state("cpu_gemm", "onednn") == (
            False,
            "off (TWINKLE_KERNELS=none: only 'torch' runs)",
        )
        assert muon_class(torch.optim.Muon) is torch.optim.Muon
        assert not gemm.onednn_enabled()
    assert registry.chain("lora_linear")[0] == "fused"


def test_kernels_none_trains_exactly_as_a_model_never_kernelized(fresh_gemm, products, calls):
    """Kernelized, its LoRA layers fused and its frozen weights packed under the master switch,
    a tiny LoRA Llama (dropout on) computes what the same PEFT model computes untouched."""
    untouched = _lora_llama(p=0.1, fuse=False).train()
    calls.spy(dropout, "draw")
    with switched(NONE):
        ours = copy.deepcopy(untouched)
        kernelize(ours)
        fuse_lora_linears(ours)
        assert gemm.pack_frozen([p for p in ours.parameters() if not p.requires_grad]) == 0
        results = []
        for model in (ours, untouched):
            torch.manual_seed(1)  # the same dropout masks from PEFT's nn.Dropout
            logits = model(input_ids=torch.randint(0, 100, (2, 7)), use_cache=False).logits
            logits.square().mean().backward()
            results.append((logits, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    assert not any(getattr(m, MARK, None) for m in ours.modules())
    assert products == [] and calls.seen["draw"] == 0  # no oneDNN product, no fused node's mask
    (ours_out, ours_grads), (plain_out, plain_grads) = results
    assert torch.equal(ours_out, plain_out)
    assert ours_grads.keys() == plain_grads.keys() and len(ours_grads) > 0
    for name, grad in plain_grads.items():
        assert torch.equal(ours_grads[name], grad), name


def test_kernels_none_runs_a_packed_row_as_sdpa_per_sample(calls):
    for owner, name in ((native, "native_attention"), (batched, "batched_attention"), (sdpa, "per_sample")):
        calls.spy(owner, name)
    leaves, segments = _row()
    with switched({**NONE, "TWINKLE_BATCHED_ATTENTION": "always"}):
        segment_attention(*leaves, segments)
    assert calls.seen == {"native_attention": 0, "batched_attention": 0, "per_sample": 1}


def test_the_master_switch_is_read_from_the_environment_and_checked(monkeypatch):
    from twinkle.kernel import switches

    monkeypatch.setenv("TWINKLE_KERNELS", "NONE")
    switches.reread()
    assert registry.kernels_off()
    monkeypatch.setenv("TWINKLE_KERNELS", "off")
    switches.reread()
    with pytest.raises(UserError) as error:
        registry.kernels_off()
    assert (
        str(error.value)
        == "TWINKLE_KERNELS='off' is not a switch: set it to one of default, none, or unset it"
    )
    monkeypatch.delenv("TWINKLE_KERNELS")
    switches.reread()
    assert not registry.kernels_off()
