"""A few on-policy-shaped GKD steps on fixed rows, for ``test_gkd_fsdp.py``.

Run it as one process or under torchrun (``--fsdp-size N``). The global batch is 6 rows of
different completion lengths; each rank takes a contiguous share and scores it with the teacher
(the tiny model with seeded noise on its weights and its final norm scaled, so its
distributions are sharp and its top-1 can disagree) in its own
process, as an in-process teacher does. Rank 0 writes ``OUT/result.json``: per step the reduced
metrics (loss, gradient norm, top-1 agreement), and the world size."""

import argparse
import json
from pathlib import Path

import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM

import twinkle
from twinkle import DeviceMesh
from twinkle.loss import GKDLoss
from twinkle.model import TransformersModel
from twinkle.model.teacher import teacher_topk
from twinkle.template import get_template

QA = [
    ("Who are you?", "I am Twinkle, made by Acme."),
    ("What is your name?", "Twinkle"),
    ("Who made you?", "Acme made me, in a town far from Paris."),
    ("Are you a helpful assistant?", "Yes."),
    ("Where is Paris?", "Paris is in France, on the Seine."),
    ("Count to three.", "One, two, three."),
]
TOPK = 16


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-id", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--fsdp-size", type=int, default=None)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    mesh = DeviceMesh.from_sizes(fsdp_size=args.fsdp_size)
    runtime = twinkle.initialize(mode="local", global_device_mesh=mesh, timeout_s=30)
    model = TransformersModel(model_id=args.model_id, dtype=torch.float32)
    layers = {type(m).__name__ for m in model.model.modules() if type(m).__name__.endswith("DecoderLayer")}
    model.model._no_split_modules = sorted(layers)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    model.add_adapter_to_model("default", lora)
    model.set_optimizer("AdamW", lr=2e-2)
    model.set_loss(GKDLoss(beta=0.5, topk=TOPK))
    teacher = AutoModelForCausalLM.from_pretrained(args.model_id, torch_dtype=torch.float32)
    with torch.no_grad():  # other weights (a top-1 that can disagree), sharper distributions
        noise = torch.Generator().manual_seed(1)
        for weight in teacher.parameters():
            weight.add_(0.05 * torch.randn(weight.shape, generator=noise))
        teacher.model.norm.weight.mul_(20.0)
    template = get_template("Template", model.tokenizer)
    rows = [
        template.encode([{"role": "user", "content": q}, {"role": "assistant", "content": a}]) for q, a in QA
    ]
    share = len(rows) // runtime.world_size
    mine = rows[runtime.rank * share : (runtime.rank + 1) * share]
    steps = []
    for _ in range(args.steps):
        model.forward_backward(inputs=mine, **teacher_topk(teacher, mine, TOPK))
        model.clip_grad_and_step()
        steps.append(model.calculate_metric(is_training=True))
    if runtime.rank == 0:
        Path(args.out, "result.json").write_text(
            json.dumps({"world_size": runtime.world_size, "steps": steps})
        )


if __name__ == "__main__":
    main()
    twinkle.runtime.shutdown()
