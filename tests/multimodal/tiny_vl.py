"""Build a tiny random Qwen2.5-VL checkpoint offline: the tests' 600-token BPE tokenizer with
Qwen's vision tokens added, a Qwen2.5-VL chat template, the image processor with a 4-pixel patch
(a 32x32 image is 64 patches, 16 visual tokens), and a 1-block vision tower in front of a
2-layer language model. No ``Qwen2_5_VLProcessor`` is saved: transformers builds one only with
its video processor, which needs torchvision; the image processor's config and the chat
template are what a checkpoint's processor files hold for images."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "assets"))

from tiny import build_tokenizer  # noqa: E402  (after the assets folder is on the path)

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2.5-VL's chat format: ChatML, each image part as <|vision_start|><|image_pad|><|vision_end|>
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PATCH = 4


def build_tiny_vl(out: str | Path, seed: int = 0) -> Path:
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    tok.add_tokens(VISION_TOKENS, special_tokens=True)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16, max_pixels=64 * 64
    )
    image_processor.save_pretrained(out)
    # name the processors as a Qwen2.5-VL checkpoint does (the torchvision class; loaded as PIL)
    path = out / "preprocessor_config.json"
    saved = json.loads(path.read_text())
    saved.update(image_processor_type="Qwen2VLImageProcessor", processor_class="Qwen2_5_VLProcessor")
    path.write_text(json.dumps(saved, indent=2))
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            bos_token_id=None,
        ),
        vision_config=dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            patch_size=PATCH,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=2 * PATCH * 2,
            out_hidden_size=32,
            fullatt_block_indexes=[0],
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(seed)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(out)
    return out


if __name__ == "__main__":
    print(build_tiny_vl(sys.argv[1]))
