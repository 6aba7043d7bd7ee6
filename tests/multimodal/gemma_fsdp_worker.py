"""A few LoRA steps of a tiny Gemma 3 or Gemma 4 (``tiny_gemma_vl.py``) on image rows, for
``test_gemma_fsdp.py``.

Run it as one process or under torchrun (``--fsdp-size N``). The global batch is 4 rows; each rank
takes a contiguous share. Odd steps: rows with 1, 2 and 1 images and a text-only row; even steps:
the second share holds text only, so that rank runs the vision tower on a dummy image only.
Rank 0 writes ``OUT/result.json``: per step the loss and gradient norm, and the world size."""

import argparse
import json
import sys
from pathlib import Path

import torch
from peft import LoraConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "assets"))

from tiny_gemma_vl import TEMPLATES  # noqa: E402  (after the assets folder is on the path)
from tiny_qwen3_vl import picture  # noqa: E402

import twinkle  # noqa: E402
from twinkle import DeviceMesh  # noqa: E402
from twinkle.model import TransformersModel  # noqa: E402
from twinkle.template import get_template  # noqa: E402

BATCHES = (["red", "two", "hello", "blue"], ["red", "two", "hello", "bye"])


def rows(template) -> dict[str, dict]:
    def row(text, reply, images=()):
        content = "<image>" * len(images) + text
        message = {"role": "user", "content": content, **({"images": list(images)} if images else {})}
        return template.encode([message, {"role": "assistant", "content": reply}])

    return {
        "red": row("What colour?", "red", [picture((32, 32), (200, 30, 30))]),
        "two": row(
            "Which is bigger?",
            "the second",
            [picture((48, 32), (30, 200, 30)), picture((64, 48), (30, 30, 200))],
        ),
        "hello": row("Say hello.", "hello there"),
        "blue": row("Colour?", "blue", [picture((32, 48), (30, 30, 200))]),
        "bye": row("Say goodbye.", "goodbye"),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--family", choices=sorted(TEMPLATES), required=True)
    p.add_argument("--model-id", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--fsdp-size", type=int, default=None)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    mesh = DeviceMesh.from_sizes(fsdp_size=args.fsdp_size)
    runtime = twinkle.initialize(mode="local", global_device_mesh=mesh, timeout_s=60)
    torch.manual_seed(0)
    model = TransformersModel(args.model_id, dtype=torch.float32)
    lora = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False
    )
    model.add_adapter_to_model("default", lora)
    template = TEMPLATES[args.family]
    model.set_template(template, model_id=args.model_id)
    model.set_optimizer("AdamW", lr=1e-2)
    encoded = rows(get_template(template, args.model_id))
    share = 4 // runtime.world_size
    steps = []
    for step in range(args.steps):
        names = BATCHES[step % 2][runtime.rank * share : (runtime.rank + 1) * share]
        model.forward_backward(inputs=[encoded[n] for n in names])
        model.clip_grad_and_step()
        metric = model.calculate_metric(is_training=True)
        steps.append({"loss": metric["loss"], "grad_norm": metric["grad_norm"]})
    if runtime.rank == 0:
        Path(args.out, "result.json").write_text(
            json.dumps({"world_size": runtime.world_size, "steps": steps})
        )


if __name__ == "__main__":
    main()
    twinkle.runtime.shutdown()
