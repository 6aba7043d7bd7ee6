"""A few DPO steps on a fixed preference batch, for ``test_dpo_fsdp.py``.

Run it as one process or under torchrun (``--fsdp-size N``). The global batch is 4 pairs, 8 rows
interleaved [chosen_1, rejected_1, ...]; each rank takes a contiguous share of whole pairs. Each
step: the reference pass with the adapters off, the DPO step against it, the metrics reduced over
ranks. Rank 0 writes ``OUT/result.json``: per step the loss, gradient norm and DPO metrics, and
the world size."""

import argparse
import json
from pathlib import Path

import torch
from peft import LoraConfig

import twinkle
from twinkle import DeviceMesh
from twinkle.dataloader import collate
from twinkle.metric import DPOMetric
from twinkle.model import TransformersModel
from twinkle.template import get_template

PAIRS = [
    ("Who are you?", "I am Twinkle, made by Acme.", "I am a robot from Paris France."),
    ("What is your name?", "Twinkle", "ModelScope"),
    ("Who made you?", "Acme made me.", "I was made in Paris France."),
    ("Are you a helpful assistant?", "Yes, I am Twinkle, a helpful assistant.", "No"),
]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-id", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--fsdp-size", type=int, default=None)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--loss-type", default="sigmoid")
    args = p.parse_args()
    mesh = DeviceMesh.from_sizes(fsdp_size=args.fsdp_size)
    runtime = twinkle.initialize(mode="local", global_device_mesh=mesh, timeout_s=30)
    model = TransformersModel(model_id=args.model_id, dtype=torch.float32)
    layers = {type(m).__name__ for m in model.model.modules() if type(m).__name__.endswith("DecoderLayer")}
    model.model._no_split_modules = sorted(layers)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    model.add_adapter_to_model("default", lora)
    model.set_optimizer("AdamW", lr=2e-2)
    model.set_loss("DPOLoss", beta=0.1, loss_type=args.loss_type, sft_weight=0.1)
    model.add_metric(DPOMetric, beta=0.1)
    template = get_template("Template", model.tokenizer)
    rows = []
    for question, chosen, rejected in PAIRS:
        for answer in (chosen, rejected):
            rows.append(
                template.encode(
                    [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
                )
            )
    share = len(rows) // runtime.world_size  # an even count: whole pairs on every rank
    batch = collate(rows[runtime.rank * share : (runtime.rank + 1) * share], model.tokenizer.pad_token_id)
    steps = []
    for _ in range(args.steps):
        ref = model.forward_only(inputs=batch, disable_lora=True)
        model.forward_backward(inputs=batch, ref_outputs=ref)
        model.clip_grad_and_step()
        steps.append(model.calculate_metric(is_training=True))
    if runtime.rank == 0:
        Path(args.out, "result.json").write_text(
            json.dumps({"world_size": runtime.world_size, "steps": steps})
        )


if __name__ == "__main__":
    main()
    twinkle.runtime.shutdown()
