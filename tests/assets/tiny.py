"""Build a tiny chat model (byte-level BPE tokenizer + 2-layer Llama) from scratch, offline.

Used by the tests and by ``python tests/assets/tiny.py OUT_DIR`` to make one by hand."""

import json
import sys
from pathlib import Path

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# The shape of every tiny Llama in the tests: 2 layers, grouped-query attention, small widths.
TINY_LLAMA_SHAPE = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)


def _corpus() -> list[str]:
    bundled = Path(__file__).resolve().parents[2] / "src/twinkle/hub/assets/self_cognition.jsonl"
    lines = []
    if bundled.exists():
        for line in bundled.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            lines += [row["query"], row["response"]]
    lines += [
        "system user assistant You are a helpful assistant.",
        "twinkle大模型 ModelScope社区 Paris France",
    ]
    return lines


def build_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    fast.chat_template = CHATML
    fast.save_pretrained(out)
    return fast


def build_tiny_model(out: str | Path, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    config = LlamaConfig(
        vocab_size=len(tok),
        **TINY_LLAMA_SHAPE,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    return out


if __name__ == "__main__":
    print(build_tiny_model(sys.argv[1]))
