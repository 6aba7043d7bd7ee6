"""A small Qwen2.5-VL checkpoint made on this machine: the bundled SmolLM2-135M-Instruct's
embeddings, first ``LAYERS`` decoder layers and final norm as its language model, and a small
random vision tower in front of it, for ``fsdp2.py`` to train in minutes on a CPU (all 30 layers
take about 25 s a step on two cores).

Qwen2's decoder is Llama's with biases on q, k and v: SmolLM2's weights go into it unchanged,
with those biases at zero, so the text half speaks as SmolLM2 does (for text tokens Qwen2.5-VL's
M-RoPE, whose three position axes are then equal, is SmolLM2's rotary embedding). The tokenizer
is SmolLM2's with Qwen's four vision tokens added (their embeddings start at the mean of the
others'), and the chat template renders an image part as
``<|vision_start|><|image_pad|><|vision_end|>``. The vision tower (2 blocks, 64 wide, 4-pixel
patches: a 32x32 picture is 16 visual tokens) and its projector into SmolLM2's 576-wide
embeddings are random: the training run teaches them.

``vl_checkpoint()`` builds it once into the Twinkle cache (``$TWINKLE_CACHE`` or
``~/.cache/twinkle``) and returns the folder."""

import json
import shutil
from pathlib import Path

import torch

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
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
LAYERS = 4
NAME = f"smollm2-135m-{LAYERS}l-vl-v1"  # a new name whenever what is built here changes


def vl_checkpoint(seed: int = 0) -> str:
    from twinkle.hub.cache import ensure_converted
    from twinkle.utils.cache import cache_root

    return str(ensure_converted(cache_root() / "cookbook" / NAME, lambda folder: build(folder, seed)))


def build(out: Path, seed: int = 0) -> None:
    from transformers import (
        AutoTokenizer,
        LlamaForCausalLM,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from twinkle.hub import resolve_model

    smol_dir = resolve_model(None)
    tokenizer = AutoTokenizer.from_pretrained(str(smol_dir))
    tokenizer.add_tokens(VISION_TOKENS, special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16, max_pixels=64 * 64
    )
    processor.save_pretrained(out)
    path = out / "preprocessor_config.json"  # named as a Qwen2.5-VL checkpoint names them
    saved = json.loads(path.read_text())
    saved.update(image_processor_type="Qwen2VLImageProcessor", processor_class="Qwen2_5_VLProcessor")
    path.write_text(json.dumps(saved, indent=2))

    smol = LlamaForCausalLM.from_pretrained(str(smol_dir), dtype=torch.float32)
    text = smol.config
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=text.hidden_size,
            intermediate_size=text.intermediate_size,
            num_hidden_layers=LAYERS,
            num_attention_heads=text.num_attention_heads,
            num_key_value_heads=text.num_key_value_heads,
            max_position_embeddings=text.max_position_embeddings,
            rms_norm_eps=text.rms_norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0, "mrope_section": [16, 8, 8]},
            tie_word_embeddings=True,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=None,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=64,
            intermediate_size=128,
            num_heads=2,
            patch_size=PATCH,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=2 * PATCH * 2,
            out_hidden_size=text.hidden_size,
            fullatt_block_indexes=[0, 1],
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    weights = {}
    for name, tensor in smol.state_dict().items():
        if name == "lm_head.weight" or (
            name.startswith("model.layers.") and int(name.split(".")[2]) >= LAYERS
        ):
            continue  # tied to the embeddings; a layer past the kept ones
        if name == "model.embed_tokens.weight":  # the vision tokens' rows: the mean embedding
            tensor = torch.cat([tensor, tensor.mean(0, keepdim=True).expand(len(VISION_TOKENS), -1)])
        weights[name.replace("model.", "model.language_model.", 1)] = tensor
    for name, tensor in model.state_dict().items():
        if name.startswith("model.language_model.") and name.endswith(
            ("q_proj.bias", "k_proj.bias", "v_proj.bias")
        ):
            weights[name] = torch.zeros_like(tensor)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected, unexpected
    assert all(n.startswith("model.visual.") or n == "lm_head.weight" for n in missing), missing
    model.save_pretrained(out)
    for extra in smol_dir.glob("generation_config.json"):
        shutil.copy(extra, out / extra.name)
