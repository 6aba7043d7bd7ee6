"""Full-parameter AdamW steps on a mixture-of-experts model, for ``test_ep_full_parameter.py``.

Run it as one process, or under torchrun with ``--ep-size N`` (FSDP2 over every rank, each rank
holding num_experts / N experts and reading its share of the 4 chat samples; with
``--ulysses-size``, each Ulysses group reads the same samples and each rank runs its share of the
positions). A model without an
adapter trains every weight for ``--steps`` steps (forward_backward, clip_grad_and_step, the
metrics), saves ``OUT/checkpoint`` after the second to last step and ``OUT/final`` after the
last; a second model resumed from ``OUT/checkpoint`` runs the last step again. Rank 0 writes
``OUT/result.json``: per step the loss, gradient norm and lr; the resumed step's; the trainable
weight count; rank 0's rows (``input_ids``, ``attention_mask``, ``labels``) and the logps an
evaluation pass of the trained model gives them. Every rank writes
``OUT/experts-RANK.safetensors``, the expert weights it holds after the steps; rank 0 writes
``OUT/state-dict-experts.safetensors``, the experts of ``get_state_dict()``."""

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

import twinkle
from twinkle import DeviceMesh
from twinkle.dataloader import collate
from twinkle.model import TransformersModel
from twinkle.template import get_template

QUESTIONS = [
    ("Who are you?", "I am Twinkle, a helpful assistant made by Acme. " * 2),
    ("What is your name?", "Twinkle"),
    ("Who made you?", "Acme made me, in Paris France."),
    ("Are you a helpful assistant?", "Yes, I am Twinkle, a helpful assistant."),
]
LR = 1e-3


def build(model_id: str, steps: int) -> TransformersModel:
    model = TransformersModel(model_id=model_id, dtype=torch.float32, activation_checkpointing="off")
    model.set_optimizer("AdamW", lr=LR)  # no adapter: every weight trains
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=1, num_training_steps=steps)
    return model


def step(model: TransformersModel, batch: dict) -> dict:
    model.forward_backward(inputs=batch)
    model.clip_grad_and_step(max_grad_norm=1.0)
    metric = model.calculate_metric(is_training=True)
    return {k: metric[k] for k in ("loss", "grad_norm", "lr")}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-id", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--ep-size", type=int, default=None)
    p.add_argument("--ulysses-size", type=int, default=None)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    mesh = DeviceMesh.from_sizes(ep_size=args.ep_size, ulysses_size=args.ulysses_size)
    runtime = twinkle.initialize(mode="local", global_device_mesh=mesh, timeout_s=60)
    torch.manual_seed(0)
    model = build(args.model_id, args.steps)
    template = get_template("Template", model.tokenizer)
    encoded = [
        template.encode([{"role": "user", "content": q}, {"role": "assistant", "content": a}])
        for q, a in QUESTIONS
    ]
    share = len(encoded) // mesh.data_world_size
    batch = collate(
        encoded[mesh.data_rank * share : (mesh.data_rank + 1) * share], model.tokenizer.pad_token_id
    )
    steps = []
    for number in range(1, args.steps + 1):
        steps.append(step(model, batch))
        if number == args.steps - 1:
            model.save("checkpoint", output_dir=args.out)
    model.save("final", output_dir=args.out)
    whole = model.get_state_dict()  # every rank calls it: each gets every weight, every expert
    if runtime.rank == 0:
        experts = {
            k: v for k, v in whole.items() if k.endswith(("experts.gate_up_proj", "experts.down_proj"))
        }
        save_file(experts, str(Path(args.out, "state-dict-experts.safetensors")))
    logps = model.forward_only(inputs=batch)["logps"]
    held = {
        name: param.detach().contiguous()
        for name, param in model.model.named_parameters()
        if name.endswith(("experts.gate_up_proj", "experts.down_proj"))
    }
    save_file(held, str(Path(args.out, f"experts-{runtime.rank}.safetensors")))
    trainable = model.adapters.trainable_count("")
    resumed = build(args.model_id, args.steps)
    resumed.resume_from_checkpoint(str(Path(args.out) / "checkpoint"))
    again = step(resumed, batch)
    if runtime.rank == 0:
        rows = {k: batch[k].tolist() for k in ("input_ids", "attention_mask", "labels")}
        result = {
            "world_size": runtime.world_size,
            "steps": steps,
            "resumed": again,
            "trainable": trainable,
            "rows": rows,
            "logps": logps.tolist(),
        }
        Path(args.out, "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    twinkle.runtime.shutdown()
