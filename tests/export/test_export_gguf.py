"""``twinkle export --gguf``: files that transformers' GGUF reader (and llama.cpp, when
llama-cpp-python is installed) load back into the merged model."""

import gguf
import pytest
import torch
from export_models import (
    PROMPTS,
    build_family_model,
    chat_ids,
    checkpoint_fixture,
    exported_fixture,
    greedy,
    logits,
    save_checkpoint,
    save_peft_adapter,
)
from tiny import build_tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from twinkle.cli.main import main
from twinkle.export import GGUF_SUBDIR, gguf_file_name, write_gguf
from twinkle.export.gguf_arch import permute_for_rope

Q = gguf.GGMLQuantizationType

checkpoint = pytest.fixture(scope="module", name="checkpoint")(checkpoint_fixture)
exported = pytest.fixture(scope="module", name="exported")(exported_fixture)


def load_gguf(folder, name):
    model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(folder), gguf_file=name)


def rounded(model, fn):
    """A copy of ``model`` whose matrices went through ``fn`` (1-D tensors stay F32 in GGUF)."""
    copy = type(model)(model.config).eval()
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        for param in copy.parameters():
            if param.ndim == 2:
                param.copy_(fn(param))
    return copy


def q8_0_round_trip(param: torch.Tensor) -> torch.Tensor:
    data = gguf.quants.quantize(param.numpy(), Q.Q8_0)
    return torch.from_numpy(gguf.dequantize(data, Q.Q8_0).reshape(param.shape).copy())


@pytest.fixture(scope="module")
def merged(exported):
    return AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()


def test_files_and_metadata(exported, merged):
    folder = exported / GGUF_SUBDIR
    assert sorted(p.name for p in folder.iterdir()) == ["tiny-chat.F16.gguf", "tiny-chat.Q8_0.gguf"]
    reader = gguf.GGUFReader(folder / gguf_file_name("tiny-chat", "f16"))
    fields = {name: field.contents() for name, field in reader.fields.items()}
    config = merged.config
    assert fields["general.architecture"] == "llama"
    expected = {
        "llama.context_length": config.max_position_embeddings,
        "llama.embedding_length": config.hidden_size,
        "llama.block_count": config.num_hidden_layers,
        "llama.feed_forward_length": config.intermediate_size,
        "llama.attention.head_count": config.num_attention_heads,
        "llama.attention.head_count_kv": config.num_key_value_heads,
        "llama.rope.dimension_count": config.hidden_size // config.num_attention_heads,
        "llama.vocab_size": config.vocab_size,
        "general.file_type": int(gguf.LlamaFileType.MOSTLY_F16),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": False,
    }
    assert {key: fields[key] for key in expected} == expected
    assert fields["llama.rope.freq_base"] == pytest.approx(config.rope_parameters["rope_theta"])
    assert fields["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(config.rms_norm_eps)
    assert "<|im_start|>" in fields["tokenizer.chat_template"]
    assert len(fields["tokenizer.ggml.tokens"]) == config.vocab_size
    assert fields["tokenizer.ggml.token_type"][:3] == [3, 3, 3]  # the three ChatML specials: control
    assert len(fields["tokenizer.ggml.merges"]) > 100 and fields["tokenizer.ggml.merges"][0].count(" ") == 1
    tensors = {t.name: t for t in reader.tensors}
    assert "output.weight" not in tensors  # tied to token_embd, as llama.cpp writes it
    assert len(tensors) == 2 + 9 * config.num_hidden_layers
    assert tensors["blk.0.attn_norm.weight"].tensor_type == Q.F32
    assert tensors["blk.0.ffn_up.weight"].tensor_type == Q.F16
    # llama.cpp's rope layout: each head's q rows interleaved from its two halves
    q = merged.model.layers[0].self_attn.q_proj.weight.detach().half().numpy()
    written = tensors["blk.0.attn_q.weight"].data
    assert (written == permute_for_rope(q, config.num_attention_heads)).all()
    assert not (written == q).all()
    q8 = gguf.GGUFReader(folder / gguf_file_name("tiny-chat", "q8_0"))
    assert {t.name: t.tensor_type for t in q8.tensors}["blk.0.ffn_up.weight"] == Q.Q8_0


def test_f16_reads_back_as_the_merged_model(exported, merged):
    tokenizer = AutoTokenizer.from_pretrained(str(exported))
    model, gguf_tokenizer = load_gguf(exported / GGUF_SUBDIR, gguf_file_name("tiny-chat", "f16"))
    assert model.config.tie_word_embeddings
    # exactly the merged weights rounded to float16: nothing is dropped, misplaced or mis-permuted
    reference = rounded(merged, lambda p: p.half().float())
    for prompt in PROMPTS:
        assert torch.equal(logits(model, tokenizer, prompt), logits(reference, tokenizer, prompt))
        assert greedy(model, tokenizer, prompt) == greedy(merged, tokenizer, prompt)
        # float16 weights: within 2e-2 of the float32 merge on these logits (|logits| < 1)
        torch.testing.assert_close(
            logits(model, tokenizer, prompt), logits(merged, tokenizer, prompt), atol=2e-2, rtol=0
        )
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False)
        assert gguf_tokenizer(text).input_ids == tokenizer(text).input_ids
    assert gguf_tokenizer.chat_template == tokenizer.chat_template
    assert (gguf_tokenizer.eos_token, gguf_tokenizer.pad_token) == (tokenizer.eos_token, tokenizer.pad_token)


def test_q8_0_loads_with_close_logits(exported, merged):
    tokenizer = AutoTokenizer.from_pretrained(str(exported))
    model, _ = load_gguf(exported / GGUF_SUBDIR, gguf_file_name("tiny-chat", "q8_0"))
    reference = rounded(merged, q8_0_round_trip)
    for prompt in PROMPTS:
        got = logits(model, tokenizer, prompt)
        assert torch.equal(got, logits(reference, tokenizer, prompt))
        # 8-bit blocks: within 0.1 of the float32 merge here (logits' std ~0.1, the random LoRA
        # makes q/k/v weights ~20x the base's, so their rounding dominates)
        torch.testing.assert_close(got, logits(merged, tokenizer, prompt), atol=0.1, rtol=0)


def test_float16_export_and_f16_gguf_agree_exactly(checkpoint, tmp_path):
    out = tmp_path / "half"
    argv = ["export", "--adapter", str(checkpoint), "--output", str(out), "--gguf"]
    assert main([*argv, "--dtype", "float16"]) == 0
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    model, _ = load_gguf(out / GGUF_SUBDIR, gguf_file_name("half", "f16"))
    for prompt in PROMPTS:
        assert torch.equal(logits(model, tokenizer, prompt), logits(hf, tokenizer, prompt))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_families_with_a_plain_peft_adapter(family, tiny_model_dir, tmp_path):
    """Untied Llama (``output.weight``); Qwen2 (q/k/v biases, embedding rows beyond the
    vocabulary, Qwen's pre-tokenizer); Qwen3 (q/k norms, head_dim 128). The adapter is a plain
    PEFT folder whose config names its base."""
    base = build_family_model(family, tiny_model_dir, tmp_path / "base")
    adapter = save_peft_adapter(base, tmp_path / "adapter")
    out = tmp_path / "out"
    assert (
        main(["export", "--adapter", str(adapter), "--output", str(out), "--gguf-type", "f32,f16,bf16"]) == 0
    )
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    exact, gguf_tokenizer = load_gguf(out / GGUF_SUBDIR, gguf_file_name("out", "f32"))
    half, _ = load_gguf(out / GGUF_SUBDIR, gguf_file_name("out", "f16"))
    brain, _ = load_gguf(out / GGUF_SUBDIR, gguf_file_name("out", "bf16"))
    assert type(exact).__name__ == type(merged).__name__
    reader = gguf.GGUFReader(out / GGUF_SUBDIR / gguf_file_name("out", "f32"))
    assert ("output.weight" in {t.name for t in reader.tensors}) == (not merged.config.tie_word_embeddings)
    assert reader.fields["general.architecture"].contents() == family
    assert reader.fields["tokenizer.ggml.pre"].contents() == ("gpt-2" if family == "llama" else "qwen2")
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == merged.config.vocab_size
    bf16_reference = rounded(merged, lambda p: p.bfloat16().float())
    for prompt in PROMPTS[:2]:
        assert torch.equal(logits(exact, tokenizer, prompt), logits(merged, tokenizer, prompt))
        assert torch.equal(logits(brain, tokenizer, prompt), logits(bf16_reference, tokenizer, prompt))
        assert greedy(half, tokenizer, prompt) == greedy(merged, tokenizer, prompt)
    for text in [*PROMPTS, "12345 apples,\n\n  and 6 pears?!", "It's x's 'd"]:
        assert gguf_tokenizer(text).input_ids == tokenizer(text).input_ids


def test_gguf_in_finetune_gguf_out(tmp_path):
    """A GGUF base (a tiny Llama written by our writer) goes through the hub conversion the way
    ``--model-id x.gguf`` does, gets an adapter, and comes back out as GGUF."""
    hf_base = build_tiny_model(tmp_path / "hf-base")
    model = AutoModelForCausalLM.from_pretrained(str(hf_base), dtype=torch.float32)
    source = write_gguf(
        tmp_path / "tiny-llama.F32.gguf",
        model.state_dict(),
        model.config,
        AutoTokenizer.from_pretrained(str(hf_base)),
        "f32",
    )
    checkpoint = save_checkpoint(source, tmp_path / "run")
    out = tmp_path / "tuned"
    assert main(["export", "--adapter", str(checkpoint), "--output", str(out), "--gguf"]) == 0
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    back, gguf_tokenizer = load_gguf(out / GGUF_SUBDIR, gguf_file_name("tuned", "f16"))
    for prompt in PROMPTS:
        assert greedy(back, tokenizer, prompt) == greedy(merged, tokenizer, prompt)
        assert gguf_tokenizer(prompt).input_ids == tokenizer(prompt).input_ids
    # the adapter changed the model: the base GGUF answers differently
    original = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=source.name, dtype=torch.float32)
    assert not torch.allclose(
        logits(original.eval(), tokenizer, PROMPTS[0]), logits(merged, tokenizer, PROMPTS[0])
    )


def test_llama_cpp_loads_and_answers(exported, merged):
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed (it compiles llama.cpp from source)"
    )
    tokenizer = AutoTokenizer.from_pretrained(str(exported))
    path = exported / GGUF_SUBDIR / gguf_file_name("tiny-chat", "f16")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_threads=1, verbose=False)
    for prompt in PROMPTS:
        ids = chat_ids(tokenizer, prompt)["input_ids"][0].tolist()
        text = tokenizer.decode(ids)
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == ids
        answer = []
        for token in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0):
            if token == llm.token_eos() or len(answer) == 3:
                break
            answer.append(token)
        # llama.cpp computes in its own kernels: the first greedy tokens agree
        assert answer == greedy(merged, tokenizer, prompt, new_tokens=3)[: len(answer)]
        assert answer
