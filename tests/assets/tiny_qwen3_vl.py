"""Build a tiny random Qwen3-VL checkpoint offline: the tests' 600-token BPE tokenizer with Qwen's
vision tokens added, a Qwen3-VL chat template, Qwen3-VL's image processor settings (16-pixel
patches, 2x2 merge, mean and std 0.5; a 64x64 image is 16 patches, 4 visual tokens) and a
2-block vision tower whose first block feeds the deepstack, in front of a 2-layer language model
with interleaved M-RoPE. No ``Qwen3VLProcessor`` is saved: transformers builds one only with its
video processor, which needs torchvision; the image processor's config and the chat template are
what a checkpoint's processor files hold for images.

``python tests/assets/tiny_qwen3_vl.py OUT_DIR`` makes one by hand."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny import build_tokenizer  # noqa: E402  (after this folder is on the path)
from tiny_vl_parts import VISION, folder, text_config  # noqa: E402

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen3-VL's chat format for images: ChatML, each image part <|vision_start|><|image_pad|><|vision_end|>
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PATCH = 16  # Qwen3-VL's patch (Qwen2.5-VL's is 14)


def qwen_processor_files(out: Path, extra_tokens: list[str], chat_template: str):
    """The tests' tokenizer with Qwen's vision tokens and ``extra_tokens`` added and
    ``chat_template`` set, and Qwen3-VL's image processor, saved in ``out`` and named as a
    Qwen3-VL (or Qwen3.5) checkpoint names them; the tokenizer and the config fields naming its
    vision tokens."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = build_tokenizer(out)
    tok.add_tokens(VISION_TOKENS + extra_tokens, special_tokens=True)
    tok.chat_template = chat_template
    tok.save_pretrained(out)
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
    # the checkpoints name the torchvision class; transformers loads it as the PIL one
    path = out / "preprocessor_config.json"
    saved = json.loads(path.read_text())
    saved.update(image_processor_type="Qwen2VLImageProcessorFast", processor_class="Qwen3VLProcessor")
    path.write_text(json.dumps(saved, indent=2))
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    token_ids = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    return tok, token_ids


def qwen_vision_config(**family) -> dict:
    """A 2-block vision tower of Qwen3-VL's shape (16-pixel patches, 2x2 merge, a 4x4 grid of
    learned positions interpolated per image), with the ``family``'s own fields."""
    return dict(
        depth=2,
        **VISION,
        num_heads=2,
        patch_size=PATCH,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=32,
        num_position_embeddings=16,
        **family,
    )


def build_tiny_qwen3_vl(out: str | Path, seed: int = 0) -> Path:
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    out = folder(out)
    tok, token_ids = qwen_processor_files(out, [], CHAT_TEMPLATE)
    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    }
    config = Qwen3VLConfig(
        text_config=text_config(tok, rope_parameters=rope),
        vision_config=qwen_vision_config(deepstack_visual_indexes=[0]),
        **token_ids,
    )
    torch.manual_seed(seed)
    Qwen3VLForConditionalGeneration(config).save_pretrained(out)
    return out


def picture(size=(64, 64), colour=(200, 30, 30)) -> bytes:
    """PNG bytes of a ``size`` (width, height) picture: ``colour`` with noise seeded by it, so
    that every patch differs and a patch out of place changes the model's output."""
    import io

    import numpy as np
    from PIL import Image

    noise = np.random.default_rng(list(colour)).integers(-40, 40, (size[1], size[0], 3))
    pixels = np.clip(np.array(colour)[None, None, :] + noise, 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


if __name__ == "__main__":
    print(build_tiny_qwen3_vl(sys.argv[1]))
