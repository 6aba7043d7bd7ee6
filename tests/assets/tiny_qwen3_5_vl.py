"""Build a tiny random Qwen3.5 checkpoint with its vision tower offline
(``Qwen3_5ForConditionalGeneration``): the tests' 600-token BPE tokenizer with Qwen's vision
tokens and ``<think>``/``</think>`` added, Qwen3-VL's chat template for images with Qwen3.5's
thinking switch, Qwen3-VL's image processor settings (16-pixel patches, 2x2 merge: a 64x64 image is 4 visual tokens), a 2-block
vision tower, and a hybrid language model of one linear-attention (Gated DeltaNet) layer then
one full-attention layer, as Qwen3.5 alternates them.

``python tests/assets/tiny_qwen3_5_vl.py OUT_DIR`` makes one by hand."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny import build_tokenizer  # noqa: E402  (after this folder is on the path)
from tiny_qwen3_vl import CHAT_TEMPLATE, PATCH, VISION_TOKENS  # noqa: E402

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
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    tok.add_tokens(VISION_TOKENS + ["<think>", "</think>"], special_tokens=True)
    tok.chat_template = QWEN3_5_CHAT_TEMPLATE
    tok.save_pretrained(out)
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH,
        merge_size=2,
        temporal_patch_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        min_pixels=32 * 32,
        max_pixels=128 * 128,
    )
    image_processor.save_pretrained(out)
    path = out / "preprocessor_config.json"  # named as a Qwen3.5 checkpoint names them
    saved = json.loads(path.read_text())
    saved.update(image_processor_type="Qwen2VLImageProcessorFast", processor_class="Qwen3VLProcessor")
    path.write_text(json.dumps(saved, indent=2))
    config = Qwen3_5Config(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
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
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            bos_token_id=None,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            patch_size=PATCH,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=32,
            num_position_embeddings=16,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
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
