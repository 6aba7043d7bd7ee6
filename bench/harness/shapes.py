"""Models for the benchmark: the bundled SmolLM2-135M-Instruct, or a randomly initialised model
of another architecture and size built from a config (no download), with SmolLM2's tokenizer.

- ``smollm2``: the bundled weights (the default; W1/W2 as specified).
- ``qwen2.5-0.5b``: Qwen2 at Qwen2.5-0.5B's sizes (24 layers, hidden 896, MLP 4864, 14 query and
  2 key/value heads, tied embeddings) over SmolLM2's 49152-token vocabulary: a Qwen-sized step
  for a GPU run.
- ``tiny``: a 2-layer Qwen2, to check the harness end to end in seconds.
- ``thin``: SmolLM2-135M's depth and heads (30 layers, 9 query and 3 key/value heads) at widths
  of 36 and 48: the same number of layers, ops and autograd nodes with almost no arithmetic, so
  a step's time is each framework's fixed cost per step.

Random weights train as well as real ones for timing and memory; the loss starts near ``ln V``."""

from pathlib import Path

import torch

SHAPES = {
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
    ),
    "thin": dict(
        hidden_size=36,
        intermediate_size=48,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
}
CHOICES = ("smollm2", *SHAPES)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def model_path(shape: str, folder: Path, seed: int, tokenizer: str | None = None) -> str | None:
    """None for the bundled model; else a folder holding a seeded random model of ``shape`` and a
    tokenizer: ``tokenizer`` (a folder with the tokenizer files; no model weights needed, so a
    machine without the bundled GGUF can run it) or the bundled model's."""
    if shape == "smollm2":
        if tokenizer is not None:
            raise SystemExit("--tokenizer goes with a random --model shape; smollm2 uses the bundled weights")
        return None
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    if tokenizer is None:
        from twinkle.hub import resolve_model

        tokenizer = str(resolve_model(None))
    target = folder / f"model-{shape}"
    if (target / "config.json").exists():
        return str(target)
    tok = AutoTokenizer.from_pretrained(tokenizer)
    config = Qwen2Config(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        **SHAPES[shape],
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(target)
    tok.save_pretrained(target)
    return str(target)
