"""Decoding steps written out layer by layer (``twinkle.sampler.lean_step``) give the model's own
forward's tokens and log-probabilities, and step aside for models they do not reproduce."""

import shutil

import pytest
import torch
from peft import LoraConfig, get_peft_model

import twinkle.sampler.decode as decode
from twinkle.data_format import SamplingParams
from twinkle.kernel import decode_step, switched
from twinkle.sampler import TorchSampler
from twinkle.sampler.lean_step import lean_step

PROMPTS = [{"input_ids": [5, 17, 99, 3, 41, 8, 250]}, {"input_ids": [7, 2]}, {"input_ids": [300, 12, 9, 14]}]


def _qwen2_dir(tiny_model_dir, out):
    """A 2-layer Qwen2 (biases on q, k and v; grouped-query attention) with the tiny tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)
    config = Qwen2Config(
        vocab_size=600,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8 if p.dim() == 2 else 1)  # sharp enough that sampled rows differ
    model.save_pretrained(out)
    for f in tiny_model_dir.iterdir():
        if f.name.startswith(("tokenizer", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


def _samples(sampler, params, monkeypatch, lean: bool, **kwargs):
    real = lean_step
    monkeypatch.setattr(decode, "lean_step", real if lean else lambda lm: None)
    used = []
    monkeypatch.setattr(decode, "LeanCache", _recording(decode.LeanCache, used))
    out = sampler.sample(PROMPTS, params, **kwargs)
    assert bool(used) == lean  # the step that ran is the one asked for
    return [seq for response in out for seq in response.sequences]


def _recording(cls, used):
    class Recording(cls):
        @classmethod
        def of(klass, cache):
            used.append(True)
            return cls.of(cache)

    return Recording


@pytest.mark.parametrize("native", ["on", "off"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_lean_steps_give_the_forward_tokens_and_logprobs(
    family, temperature, native, tiny_model_dir, tmp_path, monkeypatch
):
    """With the C kernel between the products (``native``) and with the model's modules."""
    calls = []
    real = decode_step.attention
    monkeypatch.setattr(decode_step, "attention", lambda *a: calls.append(1) or real(*a))
    with switched({"TWINKLE_NATIVE_DECODE": native}):
        _lean_equals_plain(family, temperature, tiny_model_dir, tmp_path, monkeypatch)
    assert bool(calls) == (native == "on" and decode_step.library() is not None)


def _lean_equals_plain(family, temperature, tiny_model_dir, tmp_path, monkeypatch):
    folder = tiny_model_dir if family == "llama" else _qwen2_dir(tiny_model_dir, tmp_path / "qwen2")
    sampler = TorchSampler(str(folder))
    assert lean_step(sampler.lm) is not None
    # prompts of three lengths (left pads), two samples each; a stop token that one row emits
    # early ends it there (the rows left go on with its cache rows dropped), past 64 positions
    # the cache grows
    params = SamplingParams(max_tokens=70, temperature=temperature, num_samples=2, seed=11, logprobs=2)
    first = _samples(sampler, params, monkeypatch, lean=False)
    stop = first[0].tokens[5]
    params = SamplingParams(
        max_tokens=70, temperature=temperature, num_samples=2, seed=11, logprobs=2, stop=[stop]
    )
    lean = _samples(sampler, params, monkeypatch, lean=True)
    plain = _samples(sampler, params, monkeypatch, lean=False)
    assert [s.tokens for s in lean] == [s.tokens for s in plain]
    lengths = [len(s.tokens) for s in lean]
    assert min(lengths) <= 6 and max(lengths) == 70
    for a, b in zip(lean, plain, strict=True):
        # the same fp32 operations, summed in another order by SDPA's kernel or the C kernel (~1e-6)
        got = torch.tensor([[v for _, v in entry] for entry in a.logprobs])
        want = torch.tensor([[v for _, v in entry] for entry in b.logprobs])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("native", ["on", "off"])
def test_lean_steps_with_a_lora_adapter_give_the_forward_tokens_and_logprobs(
    native, tiny_model_dir, tmp_path, monkeypatch
):
    """A LoRA adapter on attention and MLP projections: each plain-LoRA call as its base
    layer plus its rank-r products (``project``), the same tokens and log-probs as the model's
    forward through PEFT's layers, and not those of the base model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
    )
    peft = get_peft_model(lm, LoraConfig(**{**config.to_dict(), "init_lora_weights": False}))
    peft.save_pretrained(tmp_path / "adapter")
    sampler = TorchSampler(str(tiny_model_dir))
    params = SamplingParams(max_tokens=20, temperature=1.0, num_samples=2, seed=4, logprobs=1)
    with switched({"TWINKLE_NATIVE_DECODE": native}):
        lean = _samples(sampler, params, monkeypatch, lean=True, adapter_path=str(tmp_path / "adapter"))
        plain = _samples(sampler, params, monkeypatch, lean=False, adapter_path=str(tmp_path / "adapter"))
        base = _samples(sampler, params, monkeypatch, lean=True)
    assert [s.tokens for s in lean] == [s.tokens for s in plain]
    for a, b in zip(lean, plain, strict=True):
        got, want = (torch.tensor([e[0][1] for e in seq.logprobs]) for seq in (a, b))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    first = torch.tensor([seq.logprobs[0][0][1] for seq in lean])
    assert not torch.allclose(first, torch.tensor([seq.logprobs[0][0][1] for seq in base]), atol=1e-3)


def test_lean_steps_take_lora_layers_and_step_aside_for_hooks_and_other_families(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert lean_step(lm) is not None
    peft = get_peft_model(lm, LoraConfig(r=2, target_modules=["q_proj"]))
    assert lean_step(peft.get_base_model()) is not None  # a LoRA layer over a plain linear layer
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    lm.config.model_type = "gemma"
    assert lean_step(lm) is None
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    lm.model.layers[0].register_forward_pre_hook(lambda module, args: None)  # as FSDP2 does
    assert lean_step(lm) is None
