"""Tiny models of the families GGUF export writes (and one it does not), with the tiny ChatML
tokenizer; the greedy decoding the export tests compare; and the bodies of their shared
fixtures (a test module binds them with ``pytest.fixture``: a conftest.py here would shadow the
``conftest`` module other test folders import from)."""

import shutil
from pathlib import Path

import torch
import transformers
from peft import LoraConfig
from tiny import TINY_LLAMA_SHAPE

from twinkle.model import TransformersModel

# Qwen3's GGUF reader in transformers takes head_dim from Qwen3Config's default (128), not from
# the file, so the tiny Qwen3 uses that head size (2 heads keep it small). The tiny Qwen2 has
# embedding rows beyond the tokenizer's vocabulary, as the real ones do.
FAMILIES = {
    "llama": (transformers.LlamaConfig, {"tie_word_embeddings": False}),
    "qwen2": (transformers.Qwen2Config, {"tie_word_embeddings": False, "vocab_padding": 8}),
    "qwen3": (
        transformers.Qwen3Config,
        {"tie_word_embeddings": True, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128},
    ),
    "mistral": (transformers.MistralConfig, {"tie_word_embeddings": False}),
}
PROMPTS = ["Who are you?", "What is the capital of France?", "twinkle大模型 123"]
# How Qwen's tokenizer splits text before its merges (its tokenizer.json).
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def qwen_pre_tokenizer():
    from tokenizers import Regex, pre_tokenizers

    split = pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated")
    return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def build_family_model(family: str, tokenizer_dir: Path, out: Path) -> Path:
    """A 2-layer ``family`` model with the tokenizer of ``tokenizer_dir``; norms and biases are
    perturbed so that a reader that drops or misplaces them gives different logits. Qwen models
    get Qwen's pre-tokenizer."""
    config_cls, extra = FAMILIES[family]
    extra = dict(extra)
    padding = extra.pop("vocab_padding", 0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if family.startswith("qwen"):
        tokenizer.backend_tokenizer.pre_tokenizer = qwen_pre_tokenizer()
    config = config_cls(
        **{**TINY_LLAMA_SHAPE, **extra},
        vocab_size=len(tokenizer) + padding,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def save_peft_adapter(base_dir: Path, out: Path) -> Path:
    """A plain PEFT adapter folder (no Twinkle trainer state) with random, non-zero A and B."""
    from peft import get_peft_model

    base = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    torch.manual_seed(2)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(out)
    return out


def chat_ids(tokenizer, prompt: str) -> dict[str, torch.Tensor]:
    messages = [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False, return_tensors="pt")


@torch.no_grad()
def greedy(model, tokenizer, prompt: str, new_tokens: int = 8) -> list[int]:
    ids = chat_ids(tokenizer, prompt)
    out = model.generate(
        **ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
    )
    return out[0, ids["input_ids"].shape[1] :].tolist()


@torch.no_grad()
def logits(model, tokenizer, prompt: str) -> torch.Tensor:
    return model(**chat_ids(tokenizer, prompt)).logits[0]


def save_checkpoint(model_dir: Path | str, output_dir: Path) -> Path:
    """``model.save`` of a TransformersModel on ``model_dir`` whose LoRA B is random (with the
    default zero B, a merge would change nothing and prove nothing)."""
    model = TransformersModel(str(model_dir))
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    model.add_adapter_to_model("default", config)
    model.set_optimizer("AdamW", lr=1e-3)
    return Path(model.save("ck", output_dir=str(output_dir)))


def checkpoint_fixture(tiny_model_dir, tmp_path_factory) -> Path:
    """A checkpoint of the tiny Llama with a random, non-zero LoRA adapter."""
    return save_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("export-ckpt"))


def exported_fixture(checkpoint, tmp_path_factory) -> Path:
    """``twinkle export --adapter CKPT --output OUT --gguf-type f16,q8_0``; the folder."""
    from twinkle.cli.main import main

    out = tmp_path_factory.mktemp("export-out") / "tiny-chat"
    code = main(["export", "--adapter", str(checkpoint), "--output", str(out), "--gguf-type", "f16,q8_0"])
    assert code == 0
    return out
