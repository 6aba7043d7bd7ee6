"""A tiny Qwen2.5-VL whose greedy choices win by clear margins, its prompts with images, and the
Hugging Face references the image-sampling tests compare with (a module of its own: test
modules do not import ``conftest``)."""

import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multimodal"))

from tiny_vl import build_tiny_vl  # noqa: E402  (after the multimodal folder is on the path)
from vl_pictures import png_bytes  # noqa: E402

VL_CLASS = "Qwen2_5_VLForConditionalGeneration"
SCALE = 8  # the language model's matrices scaled up: the random model's logits are nearly flat


def build_sharp_vl(out: Path) -> Path:
    """``tiny_vl.build_tiny_vl`` with the language model's matrices scaled by ``SCALE``, so
    greedy tokens vary and win by margins far above fp32's rounding."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    plain = build_tiny_vl(out / "plain")
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(plain), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and ".visual." not in f".{name}":
                p.mul_(SCALE)
    sharp = out / "sharp"
    model.save_pretrained(sharp)
    for f in plain.iterdir():
        if f.suffix in (".json", ".jinja", ".txt") and not (sharp / f.name).exists():
            shutil.copy(f, sharp / f.name)
    return sharp


def image_prompt(text: str, *pictures: tuple) -> dict:
    """A chat prompt: one user turn, its pictures (``(size, colour)``) at the ``<image>`` tags
    of ``text``, or before it when it has none."""
    images = [png_bytes(size, colour) for size, colour in pictures]
    content = text if "<image>" in text else "<image>" * len(images) + text
    return {"messages": [{"role": "user", "content": content, **({"images": images} if images else {})}]}


def hf_inputs(lm, row: dict) -> dict:
    """A row (``new_input_feature``) as Qwen2.5-VL's processor hands it to the model: its
    tokens, images and which tokens are an image's."""
    ids = torch.tensor([row["input_ids"]])
    out = {"input_ids": ids, "mm_token_type_ids": (ids == lm.config.image_token_id).int()}
    if "pixel_values" in row:
        out.update(
            pixel_values=torch.as_tensor(row["pixel_values"]),
            image_grid_thw=torch.as_tensor(row["image_grid_thw"]),
        )
    return out


def teacher_forced_logps(lm, row: dict, n: int) -> torch.Tensor:
    """The log-probability of each of the row's last ``n`` tokens in one forward over the row
    with its images."""
    inputs = hf_inputs(lm, row)
    with torch.no_grad():
        logps = torch.log_softmax(lm(**inputs, use_cache=False).logits.float(), dim=-1)
    targets = inputs["input_ids"][0, 1:]
    return logps[0, :-1].gather(-1, targets[:, None]).squeeze(-1)[-n:]
