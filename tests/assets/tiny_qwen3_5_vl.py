"""Build a tiny random Qwen3.5 checkpoint with its vision tower offline
(``Qwen3_5ForConditionalGeneration``): the tests' 600-token BPE tokenizer with Qwen's vision
tokens and ``<think>``/``</think>`` added, Qwen3-VL's chat template for images with Qwen3.5's
thinking switch, Qwen3-VL's image processor settings (16-pixel patches, 2x2 merge: a 64x64 image is 4 visual tokens), a 2-block
vision tower, and a hybrid language model of one linear-attention (Gated DeltaNet) layer then
one full-attention layer, as Qwen3.5 alternates them.

``python tests/assets/tiny_qwen3_5_vl.py OUT_DIR`` makes one by hand."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_qwen3_vl import CHAT_TEMPLATE, qwen_processor_files, qwen_vision_config  # noqa: E402
from tiny_vl_parts import folder, text_config  # noqa: E402

MODEL_CLS = "Qwen3_5ForConditionalGeneration"
# Qwen3-VL's chat format with Qwen3.5's thinking switch: enable_thinking=False opens the reply
# with an empty think block, as Qwen3.5's own template does
QWEN3_5_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}",
)
assert QWEN3_5_CHAT_TEMPLATE != CHAT_TEMPLATE


def build_tiny_qwen3_5_vl(out: str | Path, seed: int = 0, scale: float = 1.0) -> Path:
    """The checkpoint in ``out``; ``scale`` multiplies every weight matrix, so that a sampling
    test's greedy tokens vary, follow the pixels and win by margins far above fp32's rounding."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    out = folder(out)
    tok, token_ids = qwen_processor_files(out, ["<think>", "</think>"], QWEN3_5_CHAT_TEMPLATE)
    config = Qwen3_5Config(
        text_config=text_config(
            tok,
            max_position_embeddings=4096,
            # the whole head rotates (Qwen3.5 rotates a quarter of its 256): 4 frequencies, so
            # that the height and width axes of M-RoPE each get one
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 1.0,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            layer_types=["linear_attention", "full_attention"],
        ),
        vision_config=qwen_vision_config(),
        **token_ids,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    model.save_pretrained(out)
    return out


if __name__ == "__main__":
    print(build_tiny_qwen3_5_vl(sys.argv[1]))
