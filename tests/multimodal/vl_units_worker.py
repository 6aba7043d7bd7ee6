"""A few LoRA steps of the tiny Qwen2.5-VL, Gemma 3 or Gemma 4 on image rows, for
``test_vl_fsdp_units.py``.

Run it as one process or under torchrun (``--fsdp-size N``). The global batch is 4 rows; each rank
takes a contiguous share. The steps: both shares hold images; the second share holds text only;
no share holds an image; the second share holds text only again. ``--tower-lora`` puts LoRA on
the vision tower and projector too. Each rank writes ``OUT/result-RANK.json``: per step the loss,
the gradient norm and how many times the tower has run so far, the world size, whether each
vision block is an FSDP unit, the tower's LoRA parameters, and the greedy tokens a sampler
sharing the model gave its prompts (each step's token and runner-up with their log-probs) (rank 0's holds an image, rank 1's none); the adapter is saved under
``OUT/adapter``."""

import argparse
import json
from pathlib import Path

import torch
from peft import LoraConfig
from vl_worker import png

import twinkle
from twinkle import DeviceMesh
from twinkle.data_format.sampling import SamplingParams
from twinkle.model import TransformersModel
from twinkle.sampler import TorchSampler
from twinkle.template import get_template

# family -> (model_cls, template, the tower's attribute on the inner model, its block class)
FAMILIES = {
    "qwen2_5_vl": (
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen2_5VLTemplate",
        "visual",
        "Qwen2_5_VLVisionBlock",
    ),
    "gemma3": (None, "Gemma3Template", "vision_tower", "SiglipEncoderLayer"),
    "gemma4": (None, "Gemma4Template", "vision_tower", "Gemma4VisionEncoderLayer"),
}
BATCHES = (
    ["red", "two", "hello", "blue"],
    ["red", "two", "hello", "bye"],
    ["hello", "bye", "hello", "bye"],
    ["two", "blue", "bye", "hello"],
)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-id", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--fsdp-size", type=int, default=None)
    p.add_argument("--family", choices=sorted(FAMILIES), default="qwen2_5_vl")
    p.add_argument("--tower-lora", action="store_true")
    args = p.parse_args()
    mesh = DeviceMesh.from_sizes(fsdp_size=args.fsdp_size)
    runtime = twinkle.initialize(mode="local", global_device_mesh=mesh, timeout_s=60)
    torch.manual_seed(0)
    model_cls, template, tower, block = FAMILIES[args.family]
    model = TransformersModel(args.model_id, model_cls=model_cls, dtype=torch.float32)
    extra = {"exclude_modules": []} if args.tower_lora else {}
    lora = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False, **extra
    )
    model.add_adapter_to_model("default", lora)
    model.set_template(template, model_id=args.model_id)
    model.set_optimizer("AdamW", lr=1e-2)
    if args.family == "qwen2_5_vl":
        from vl_worker import rows
    else:
        from gemma_fsdp_worker import rows
    encoded = rows(get_template(template, args.model_id))
    share = 4 // runtime.world_size
    visual = getattr(model.model.get_base_model().model, tower)
    runs = []  # the tower's forwards, real or dummy
    visual.register_forward_hook(lambda *_: runs.append(1))
    steps = []
    for names in BATCHES:
        mine = names[runtime.rank * share : (runtime.rank + 1) * share]
        model.forward_backward(inputs=[encoded[n] for n in mine])
        model.clip_grad_and_step()
        metric = model.calculate_metric(is_training=True)
        steps.append({"loss": metric["loss"], "grad_norm": metric["grad_norm"], "tower_runs": len(runs)})
    # a sampler sharing the model: rank 0's prompt holds an image, rank 1's is text only
    image = {"role": "user", "content": "<image>What colour?", "images": [png((32, 32), (200, 30, 30))]}
    shares = [[{"messages": [image]}], [{"messages": [{"role": "user", "content": "Say hello."}]}]]
    sampler = TorchSampler(model)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, logprobs=2)  # the runner-up too
    sampled = []
    for share in shares if runtime.world_size == 1 else [shares[runtime.rank]]:
        sampled += [s.logprobs for r in sampler.sample(share, greedy) for s in r.sequences]
    from torch.distributed.fsdp import FSDPModule

    blocks = [m for m in model.model.modules() if block in {c.__name__ for c in type(m).__mro__}]
    tower_lora = sum(
        p.numel() for n, p in model.model.named_parameters() if f".{tower}." in n and "lora_" in n
    )
    model.save("adapter", output_dir=args.out, adapter_name="default", save_optimizer=False)
    result = {
        "world_size": runtime.world_size,
        "steps": steps,
        "blocks_are_units": [isinstance(b, FSDPModule) for b in blocks],
        "tower_lora": tower_lora,
        "sampled": sampled,
    }
    Path(args.out, f"result-{runtime.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    twinkle.runtime.shutdown()
