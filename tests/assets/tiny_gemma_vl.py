"""Build tiny random Gemma 3 and Gemma 4 vision-language checkpoints offline: the tests' 600-token
BPE tokenizer with the family's image and turn tokens added (named as the family's tokenizer names
them: ``image_token``, ``boi_token``, ``eoi_token``), a chat template in the family's format, the
family's PIL image processor at a small size, and a 1-block vision tower in front of a 2-layer
language model (one sliding-window layer, one global layer, as the families alternate them).

- Gemma 3: a 32x32 image in 4-pixel patches (64 patches) pooled to 16 soft tokens
  (``mm_tokens_per_image``); the chat template writes ``<start_of_image>`` per image.
- Gemma 4: an image resized to fit 70 soft tokens of 3x3 pooled 4-pixel patches (a square image:
  8x8 = 64 soft tokens); image tokens attend to each other both ways
  (``use_bidirectional_attention='vision'``, as the larger Gemma 4 models); the chat template
  writes ``<|image|>`` per image.

No processor object is saved: transformers builds Gemma 4's only with its video processor, which
needs torchvision; the image processor's config, ``processor_config.json`` and the chat template
are what a checkpoint's processor files hold for images.

``python tests/assets/tiny_gemma_vl.py gemma3|gemma4 OUT_DIR`` makes one by hand."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny import build_tokenizer  # noqa: E402  (after this folder is on the path)
from tiny_vl_parts import VISION, folder, text_config  # noqa: E402

GEMMA3_TOKENS = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}
GEMMA4_TOKENS = {"boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>"}
GEMMA4_VIDEO = "<|video|>"

# Gemma 3's turns: <start_of_turn>user|model ... <end_of_turn>, an image part as <start_of_image>
GEMMA3_CHAT = (
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# Gemma 4's turns: <|turn>user|model ... <turn|>, an image part as <|image|>
GEMMA4_CHAT = (
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<|turn>{{ role }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|image|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}<turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


def _tokenizer(out: Path, named: dict[str, str], extra: list[str], chat_template: str):
    """The tests' tokenizer with ``named`` tokens (saved under their names, as the family's
    tokenizer_config.json holds them) and ``extra`` special tokens."""
    from transformers import AutoTokenizer

    tok = build_tokenizer(out)
    tok.add_tokens([*named.values(), *extra], special_tokens=True)
    tok.chat_template = chat_template
    tok.save_pretrained(out)
    path = out / "tokenizer_config.json"
    saved = json.loads(path.read_text())
    saved["extra_special_tokens"] = named
    path.write_text(json.dumps(saved, indent=2))
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.image_token == named["image_token"], "the tokenizer must name its image token"
    return tok


def _processor_files(out: Path, image_processor, processor: dict) -> None:
    image_processor.save_pretrained(out)
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2))


def build_tiny_gemma3(out: str | Path, seed: int = 0) -> Path:
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    out = folder(out)
    tok = _tokenizer(out, GEMMA3_TOKENS, ["<start_of_turn>", "<end_of_turn>"], GEMMA3_CHAT)
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in GEMMA3_TOKENS.items()}
    image_processor = Gemma3ImageProcessorPil(
        size={"height": 32, "width": 32}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    _processor_files(out, image_processor, {"image_seq_length": 16, "processor_class": "Gemma3Processor"})
    config = Gemma3Config(
        text_config=text_config(
            tok,
            query_pre_attn_scalar=8,
            sliding_window=24,  # shorter than a row: the sliding layer's window cuts across images
            layer_types=["sliding_attention", "full_attention"],
        ),
        vision_config=dict(**VISION, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=4),
        mm_tokens_per_image=16,
        boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"],
        image_token_index=ids["image_token"],
    )
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # HF initialises the projector to zeros: every image would look alike
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(std=0.2)
    model.save_pretrained(out)
    return out


def build_tiny_gemma4(out: str | Path, seed: int = 0) -> Path:
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    out = folder(out)
    tok = _tokenizer(out, GEMMA4_TOKENS, [GEMMA4_VIDEO, "<|turn>", "<turn|>"], GEMMA4_CHAT)
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in GEMMA4_TOKENS.items()}
    image_processor = Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=70, pooling_kernel_size=3)
    _processor_files(out, image_processor, {"image_seq_length": 70, "processor_class": "Gemma4Processor"})
    config = Gemma4Config(
        text_config=text_config(
            tok,
            global_head_dim=16,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=len(tok),
            sliding_window=24,
            layer_types=["sliding_attention", "full_attention"],
            use_bidirectional_attention="vision",
            final_logit_softcapping=30.0,  # as Gemma 4's checkpoints: the head's logits are soft-capped
        ),
        vision_config=dict(
            **VISION,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=16,
            patch_size=4,
            pooling_kernel_size=3,
            position_embedding_size=64,
        ),
        audio_config=None,
        boi_token_id=ids["boi_token"],
        eoi_token_id=ids["eoi_token"],
        image_token_id=ids["image_token"],
        video_token_id=tok.convert_tokens_to_ids(GEMMA4_VIDEO),
        audio_token_id=None,
        boa_token_id=None,
        eoa_token_index=None,
    )
    torch.manual_seed(seed)
    Gemma4ForConditionalGeneration(config).save_pretrained(out)
    return out


BUILDERS = {"gemma3": build_tiny_gemma3, "gemma4": build_tiny_gemma4}
TEMPLATES = {"gemma3": "Gemma3Template", "gemma4": "Gemma4Template"}


def conversation_rows(template) -> list[dict]:
    """Three rows as upstream's scripts write them (``<image>`` tags in the user turn): one image,
    no image, and two images of other sizes (Gemma 4 gives each its own token count)."""
    from tiny_qwen3_vl import picture

    def row(text, reply, images):
        content = "<image>" * len(images) + text
        message = {"role": "user", "content": content, **({"images": images} if images else {})}
        return template.encode([message, {"role": "assistant", "content": reply}])

    return [
        row("What colour?", "red", [picture((32, 32), (200, 30, 30))]),
        row("Say hello.", "hello there", []),
        row(
            "Which is bigger?",
            "the second",
            [picture((48, 32), (30, 200, 30)), picture((64, 40), (30, 30, 200))],
        ),
    ]


if __name__ == "__main__":
    print(BUILDERS[sys.argv[1]](sys.argv[2]))
