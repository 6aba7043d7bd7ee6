"""The pieces of the GGUF writer: rope permutation, tensor names and types, tokenizer metadata,
and the refusals that keep a file GGUF readers would misread from being written."""

import logging

import numpy as np
import pytest
import torch
from export_models import QWEN_SPLIT
from transformers import AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast

from twinkle.export import gguf_tokenizer as tok_meta
from twinkle.export.gguf_arch import gguf_arch, gguf_tensor_name, permute_for_rope, rope_theta
from twinkle.export.gguf_writer import Q, tensor_type, write_gguf
from twinkle.utils.errors import UserError


def test_permute_for_rope_interleaves_the_two_halves_of_each_head():
    rows = np.arange(8, dtype=np.float32).reshape(8, 1)  # 2 heads of 4: [a0 a1 b0 b1] [c0 c1 d0 d1]
    assert permute_for_rope(rows, 2)[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert permute_for_rope(np.arange(8.0), 2).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]  # a bias


def test_tensor_names():
    assert gguf_tensor_name("model.embed_tokens.weight") == "token_embd.weight"
    assert gguf_tensor_name("model.layers.3.self_attn.k_proj.bias") == "blk.3.attn_k.bias"
    assert gguf_tensor_name("model.layers.0.self_attn.q_norm.weight") == "blk.0.attn_q_norm.weight"
    assert gguf_tensor_name("model.layers.1.post_attention_layernorm.weight") == "blk.1.ffn_norm.weight"
    assert gguf_tensor_name("lm_head.weight") == "output.weight"
    assert gguf_tensor_name("model.rotary_emb.inv_freq") is None
    with pytest.raises(UserError, match="has no GGUF name"):
        gguf_tensor_name("model.layers.0.mlp.experts.0.up_proj.weight")


def test_tensor_types_follow_llama_cpp():
    assert tensor_type((64,), "q8_0") == Q.F32  # norms and biases stay F32
    assert tensor_type((16, 64), "q8_0") == Q.Q8_0
    assert tensor_type((16, 48), "q8_0") == Q.F16  # rows of 48 are not whole 32-value blocks
    assert tensor_type((16, 48), "bf16") == Q.BF16


def test_unknown_architecture_and_type():
    with pytest.raises(UserError, match="supported architectures: llama, qwen2, qwen3"):
        gguf_arch("gpt2")
    with pytest.raises(UserError, match="q4_0 is not supported for qwen2; choose from f32, f16, bf16, q8_0"):
        gguf_arch("qwen2", ("f16", "q4_0"))


def test_rope_scaling_is_refused():
    config = LlamaConfig(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(UserError, match="rope scaling 'linear'"):
        rope_theta(config)
    assert rope_theta(LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 5e5})) == 5e5


def test_pre_tokenizer_names(caplog):
    def byte_level(regex: bool) -> dict:
        return {"type": "ByteLevel", "use_regex": regex}

    def sequence(*steps: dict) -> dict:
        return {"type": "Sequence", "pretokenizers": list(steps)}

    def split(pattern: str) -> dict:
        return {"type": "Split", "pattern": {"Regex": pattern}}

    assert tok_meta._pre_tokenizer_name(byte_level(True)) == "gpt-2"
    assert tok_meta._pre_tokenizer_name(
        sequence({"type": "Digits", "individual_digits": True}, byte_level(True))
    ) == ("smollm")
    assert tok_meta._pre_tokenizer_name(sequence(split(QWEN_SPLIT), byte_level(False))) == "qwen2"
    assert (
        tok_meta._pre_tokenizer_name(sequence(split(tok_meta._LLAMA3_SPLIT), byte_level(False)))
        == "llama-bpe"
    )
    with caplog.at_level(logging.WARNING):
        assert tok_meta._pre_tokenizer_name(sequence(split("x"), byte_level(False))) == "default"
    assert "no llama.cpp name" in caplog.text


def test_qwen_split_is_the_one_transformers_knows():
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    assert tok_meta._QWEN2_SPLIT == PRETOKENIZE_REGEX == QWEN_SPLIT


def test_only_byte_level_bpe_tokenizers(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    word_level = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level)
    with pytest.raises(UserError, match="only byte-level BPE tokenizers"):
        tok_meta.tokenizer_metadata(tokenizer, 3)


def test_vocabulary_is_padded_to_the_embedding_rows(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    meta = tok_meta.tokenizer_metadata(tokenizer, len(tokenizer) + 2)
    assert meta.tokens[-2:] == [f"[PAD{len(tokenizer)}]", f"[PAD{len(tokenizer) + 1}]"]
    assert meta.token_types[-2:] == [5, 5] and meta.token_types[:3] == [3, 3, 3]
    assert meta.special_ids == {"eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id}
    with pytest.raises(UserError, match="do not belong together"):
        tok_meta.tokenizer_metadata(tokenizer, len(tokenizer) - 1)


def test_a_refused_write_leaves_no_file(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    with pytest.raises(UserError, match="q4_k"):
        write_gguf(tmp_path / "x.gguf", model.state_dict(), model.config, tokenizer, "q4_k")
    assert not (tmp_path / "x.gguf").exists()


def test_a_write_that_fails_midway_leaves_no_file(tiny_model_dir, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from twinkle.export import gguf_writer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    calls = []
    encode = gguf_writer._encode

    def fail_on_the_third(array, qtype):
        calls.append(qtype)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return encode(array, qtype)

    monkeypatch.setattr(gguf_writer, "_encode", fail_on_the_third)
    with pytest.raises(OSError):
        write_gguf(tmp_path / "x.gguf", model.state_dict(), model.config, tokenizer, "f16")
    assert list(tmp_path.iterdir()) == []
