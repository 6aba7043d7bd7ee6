"""The CPU-only helpers (oneDNN's products, packing and measurements, the C attention kernel,
pooled and batched attention, the dropout C kernel) are reached only for CPU tensors. The real
dispatch code runs on tensors of the ``meta`` device, which stand for any device other than the
CPU (each check asks ``device.type == "cpu"``): none of the helpers may be called. The same calls
on fp32 CPU tensors reach them, so the spies are known to see the calls. ``tests/gpu`` checks the
same on CUDA during a training step."""

import pytest
import torch
from masks import record
from peft import LoraConfig, get_peft_model

from twinkle.kernel import KernelChoice, kernelize, switched
from twinkle.kernel import cpu_gemm as gemm
from twinkle.kernel.attention import batched, native, pooled
from twinkle.kernel.attention.packed import Segments, segment_attention
from twinkle.kernel.lora import dropout
from twinkle.kernel.lora.linear import fuse_lora_linears

HELPERS = [
    (gemm, "_linear_pointwise"),
    (gemm, "_pack"),
    (gemm, "_measure"),
    (native, "library"),
    (native, "native_attention"),
    (pooled, "pool"),
    (pooled, "pooled_rows"),
    (batched, "batched_attention"),
    (dropout, "_library"),
]


@pytest.fixture
def helper_calls(monkeypatch):
    """Calls into each CPU-only helper, by name (the calls still run)."""
    calls: dict[str, int] = {}

    def spy(owner, name):
        real, key = getattr(owner, name), f"{owner.__name__.rsplit('.', 1)[-1]}.{name}"
        calls[key] = 0

        def counted(*args, **kwargs):
            calls[key] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)

    for owner, name in HELPERS:
        spy(owner, name)
    return calls


def _dispatch(device: str) -> None:
    """Every dispatching entry point once, on ``device``: dropout (mask, masked products and
    their gradients), the frozen weights' products and packing, a packed row's attention."""
    torch.manual_seed(0)
    x, a, g = (torch.randn(s).to(device) for s in ((30, 64), (4, 64), (30, 4)))
    drop = dropout.draw(0.1)
    dropout.apply(x, drop)
    dropout.masked_low(x, a, (drop,))
    dropout.masked_input_grads(x, a, g, (drop,), torch.zeros(30, 64, device=device), True)
    w = torch.randn(16, 64).to(device)
    with torch.no_grad():
        gemm.linear(x, w)
        gemm.times_weight(torch.randn(30, 16).to(device), w)
    gemm.pack_frozen([w])
    q, k = torch.randn(1, 4, 40, 16).to(device), torch.randn(1, 2, 40, 16).to(device)
    segments = Segments(((0, 12), (12, 40)))
    for mode in ("always", "off"):  # pooled attention for any row, then the next backends
        with switched({"TWINKLE_POOLED_ATTENTION": mode}):
            segment_attention(q, k, k, segments)
    with switched({"TWINKLE_NATIVE_ATTENTION": "off", "TWINKLE_POOLED_ATTENTION": "off"}):
        segment_attention(q, k, k, segments)


def test_no_cpu_only_helper_is_reached_for_tensors_off_the_cpu(helper_calls, fresh_gemm):
    _dispatch("meta")
    assert not any(helper_calls.values()), helper_calls


def test_the_same_calls_on_the_cpu_reach_the_helpers(helper_calls, fresh_gemm):
    """The control: on fp32 CPU tensors the helpers this machine can run are reached."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # pooled attention needs more than one thread
    try:
        _dispatch("cpu")
    finally:
        torch.set_num_threads(threads)
    assert helper_calls["dropout._library"] > 0
    assert helper_calls["native.native_attention"] + helper_calls["batched.batched_attention"] > 0, (
        helper_calls
    )
    if gemm.onednn_enabled():
        assert helper_calls["cpu_gemm._linear_pointwise"] > 0, helper_calls


def test_a_kernelized_lora_model_off_the_cpu_reaches_no_cpu_only_helper(
    helper_calls, tiny_llama, torch_mapping, monkeypatch
):
    """A tiny Llama's decoder layers with LoRA (dropout on) in their fused nodes and kernels,
    forward and backward on the ``meta`` device: the nodes' dispatch never asks a CPU-only
    helper."""
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.1, init_lora_weights=False
    )
    model = get_peft_model(tiny_llama(), config)
    fuse_lora_linears(model)
    mapping = {**torch_mapping, "LlamaAttention": KernelChoice("lora_attention", ("torch",))}
    model = kernelize(model, mapping).to("meta").train()
    decoder = model.base_model.model.model
    # the decoder layers themselves: the model's mask building reads values, which meta lacks
    hidden = torch.randn(2, 13, decoder.config.hidden_size, device="meta", requires_grad=True)
    positions = torch.arange(13, device="meta").expand(2, -1)
    rotary = decoder.rotary_emb(hidden, positions)
    real_autocast = torch.is_autocast_enabled
    # autocast has no meta device to ask about; no autocast is on, as on a GPU without it
    monkeypatch.setattr(
        torch, "is_autocast_enabled", lambda *device: False if device == ("meta",) else real_autocast(*device)
    )
    drawn = record(monkeypatch)
    out = hidden
    for layer in decoder.layers:
        out = layer(out, attention_mask=None, position_ids=positions, position_embeddings=rotary)
        out = out[0] if isinstance(out, tuple) else out
    out.sum().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and g.device.type == "meta" for g in grads)
    assert len(drawn) == 7 * 2  # the fused nodes ran: one mask per adapter call (q k v o gate up down)
    assert not any(helper_calls.values()), helper_calls
