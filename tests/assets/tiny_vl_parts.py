"""What the tiny vision-language checkpoint builders (``tiny_qwen3_vl``, ``tiny_qwen3_5_vl``,
``tiny_gemma_vl``) share: one language model size for every family, the config fields each
family fills from the tokenizer the same way, and a folder made ready for a checkpoint: a
2-layer language model of width 32 with grouped key/value heads (4 query heads over 2)."""

from pathlib import Path

TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)
VISION = dict(hidden_size=32, intermediate_size=64)


def text_config(tok, max_position_embeddings: int = 512, **family) -> dict:
    """The language model's config over ``tok``: ``TEXT``'s sizes, its vocabulary, end and
    padding tokens, no beginning-of-text token, and the ``family``'s own fields."""
    return dict(
        vocab_size=len(tok),
        **TEXT,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        **family,
    )


def folder(out: str | Path) -> Path:
    """``out`` as a path, made if missing."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return out
