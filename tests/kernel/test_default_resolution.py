"""What each call op resolves to under the default chain table, on fp32 CPU tensors: the first
backend of its chain that this machine can run and that takes the call. Spies on each backend's
entry point see which one ran; a change of dispatch that changes a default choice (and so the
numbers of a default run) fails here."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from tiny import TINY_LLAMA_SHAPE
from transformers import LlamaConfig, LlamaForCausalLM

from twinkle.kernel import cpu_gemm as gemm
from twinkle.kernel import kernelize, registry
from twinkle.kernel.attention import batched, native, pooled, sdpa
from twinkle.kernel.attention.packed import Segments, segment_attention
from twinkle.kernel.lora import dropout
from twinkle.kernel.lora import linear as lora_linear_mod
from twinkle.kernel.lora import mlp as lora_mlp_mod
from twinkle.kernel.lora import qkv as lora_qkv_mod
from twinkle.kernel.lora.linear import fuse_lora_linears
from twinkle.kernel.muon import BatchedMuon, muon_class


@pytest.fixture
def ran(monkeypatch):
    """``ran(owner, name, label)`` spies on ``owner.name``; the returned list holds the labels of
    the calls, in order (the calls still run)."""
    log: list[str] = []

    def spy(owner, name, label):
        real = getattr(owner, name)

        def counted(*args, **kwargs):
            log.append(label)
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)

    spy.log = log
    return spy


def _usable(op: str, backend: str) -> bool:
    return registry.state(op, backend)[0]


def _row():
    torch.manual_seed(0)
    spans = ((0, 12), (12, 40))
    q, k, v = (torch.randn(1, h, 40, 16) for h in (4, 2, 2))
    return (q, k, v), Segments(spans)


def test_packed_attention_takes_the_first_usable_backend(ran):
    for module, name in ((native, "native_attention"), (pooled, "pooled_rows")):
        ran(module, name, name.split("_")[0])
    ran(batched, "batched_attention", "batched")
    ran(sdpa, "per_sample", "sdpa")
    leaves, segments = _row()
    segment_attention(*leaves, segments)
    expected = "native" if _usable("packed_attention", "native") else None
    if expected is None:  # a short row: not pooled's (auto), batched where its cost model pays
        assert ran.log and ran.log[0] in ("batched", "sdpa"), ran.log
    else:
        assert ran.log == ["native"]


def _lora_llama(dropout_p: float) -> torch.nn.Module:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA_SHAPE, vocab_size=100))
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=dropout_p)
    peft_model = get_peft_model(kernelize(model), lora)
    fuse_lora_linears(peft_model)
    return peft_model.train()


def test_the_lora_ops_and_the_frozen_products_take_their_first_backend(ran, fresh_gemm, monkeypatch):
    model = _lora_llama(0.1)
    frozen = [p for p in model.parameters() if p.dim() == 2 and not p.requires_grad]
    gemm.pack_frozen(frozen)
    native_dropout = dropout._library() is not None  # built and checked before the spies
    packed_ids = {id(entry[3]) for entry in gemm._packed.values()}
    ran(lora_linear_mod, "lora_linear", "lora_linear")
    ran(lora_mlp_mod._LoraMLP, "apply", "lora_mlp")
    ran(lora_qkv_mod._LoraQKV, "apply", "lora_qkv")
    ran(dropout, "keep_mask", "dropout-torch")
    products: list[str] = []
    real = gemm._linear_pointwise

    def product(x, w, bias):
        products.append("packed" if id(w) in packed_ids else "onednn")
        return real(x, w, bias)

    monkeypatch.setattr(gemm, "_linear_pointwise", product)
    ids = torch.randint(0, 100, (1, 9))
    model(input_ids=ids, use_cache=False).logits.square().sum().backward()
    # two layers: q/k/v one node each, the MLP one node each, o_proj a one-node LoRA layer each
    assert ran.log.count("lora_qkv") == 2 and ran.log.count("lora_mlp") == 2
    assert ran.log.count("lora_linear") == 2
    assert ("dropout-torch" in ran.log) is not native_dropout  # the masks from the C kernel
    if _usable("cpu_gemm", "packed"):
        assert "packed" in products  # the forward products from the packed copies
    if _usable("cpu_gemm", "onednn"):
        assert "onednn" in products  # the input gradients from the dense weights
    else:
        assert products == []


def test_muon_resolves_to_the_batched_step():
    assert muon_class(torch.optim.Muon) is BatchedMuon
    assert muon_class(torch.optim.AdamW) is torch.optim.AdamW
