"""A few LoRA steps on one fixed batch, for ``test_sequence_parallel.py``.

Run it as one process, or under torchrun with ``--ulysses-size N`` (``--fsdp-size`` defaults to
the world size): the N ranks of a Ulysses group read the same rows and each runs a share of the
positions. The batch is 4 chat samples of unequal length, one of them longer than half of the
packed row, so a sample straddles the ranks' shares. Each step: forward_backward,
clip_grad_and_step, the metrics. Rank 0 writes ``OUT/result.json`` (per step the loss, gradient
norm, the samples and tokens counted, this rank's token count; the world size; the logps of an
evaluation pass) and the adapter saved after the last step (``OUT/adapter``).
``--padded`` runs the padded batch instead of the packed row (``padding_free=False``);
``--activation-checkpointing on`` recomputes each layer (and its all-to-alls) in the backward;
``--mixed`` builds a ``MultiLoraTransformersModel`` with a second adapter and evaluates each row
through its own adapter; ``--long-prompt`` trains on one sample whose targets all lie in the last
rank's share; ``--lora-head`` puts LoRA on the head too (the loss then reads the model's logits)."""

import argparse
import json
from functools import partial
from pathlib import Path

import torch
from peft import LoraConfig

import twinkle
from twinkle import DeviceMesh
from twinkle.dataloader import collate
from twinkle.model import MultiLoraTransformersModel, TransformersModel
from twinkle.template import get_template

QUESTIONS = [
    ("Who are you?", "I am Twinkle, a helpful assistant made by Acme. " * 12),
    ("What is your name?", "Twinkle"),
    ("Who made you?", "Acme made me, in Paris France. " * 3),
    ("Are you a helpful assistant?", "Yes, I am Twinkle, a helpful assistant."),
]


# one sample whose targets all lie in the last rank's share: the first rank scores nothing
LONG_PROMPT = [("Who are you? " * 40, "Twinkle")]


def rows(tokenizer, questions=QUESTIONS) -> list[dict]:
    template = get_template("Template", tokenizer)
    return [
        template.encode([{"role": "user", "content": q}, {"role": "assistant", "content": a}])
        for q, a in questions
    ]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-id", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--ulysses-size", type=int, default=None)
    p.add_argument("--fsdp-size", type=int, default=None)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--padded", action="store_true")
    p.add_argument("--activation-checkpointing", default="off")
    p.add_argument("--mixed", action="store_true")
    p.add_argument("--long-prompt", action="store_true")
    p.add_argument("--lora-head", action="store_true")
    args = p.parse_args()
    mesh = DeviceMesh.from_sizes(fsdp_size=args.fsdp_size, ulysses_size=args.ulysses_size)
    runtime = twinkle.initialize(mode="local", global_device_mesh=mesh, timeout_s=30)
    model_cls = partial(MultiLoraTransformersModel, max_loras=2, max_r=4) if args.mixed else TransformersModel
    model = model_cls(
        model_id=args.model_id,
        dtype=torch.float32,
        padding_free=not args.padded,
        activation_checkpointing=args.activation_checkpointing,
    )
    layers = {type(m).__name__ for m in model.model.modules() if type(m).__name__.endswith("DecoderLayer")}
    model.model._no_split_modules = sorted(layers)
    torch.manual_seed(0)
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj", "lm_head"] if args.lora_head else "all-linear",
    )
    if not args.mixed:  # B random too: every LoRA weight has a gradient from the first step (slots: zero)
        lora.init_lora_weights = False
    model.add_adapter_to_model("default", lora)
    if args.mixed:
        model.add_adapter_to_model("other", lora)
    model.set_optimizer("AdamW", lr=1e-2, adapter_name="default")
    encoded = rows(model.tokenizer, LONG_PROMPT if args.long_prompt else QUESTIONS)
    # the Ulysses ranks of a group read the same rows: every data rank here reads all of them
    share = len(encoded) // mesh.data_world_size
    mine = encoded[mesh.data_rank * share : (mesh.data_rank + 1) * share]
    batch = collate(mine, model.tokenizer.pad_token_id)
    steps = []
    for _ in range(args.steps):
        out = model.forward_backward(inputs=batch, adapter_name="default")
        model.clip_grad_and_step(adapter_name="default")
        metric = model.calculate_metric(is_training=True, adapter_name="default")
        steps.append(
            {
                **{k: metric[k] for k in ("loss", "grad_norm", "samples", "tokens", "supervised_tokens")},
                "rank_tokens": out.get("num_tokens"),
            }
        )
    model.save("adapter", output_dir=args.out, adapter_name="default", save_optimizer=False)
    # an evaluation pass: every rank's logps cover the whole batch
    if args.mixed:  # each row through its own adapter (None: the base model)
        names = ["default", "other", "default", None][: batch["input_ids"].shape[0]]
        logps = model.forward_only(inputs=batch, adapter_names=names)["logps"]
    else:
        logps = model.forward_only(inputs=batch, adapter_name="default")["logps"]
        model.calculate_loss()
        evaluation = model.calculate_metric(is_training=False, adapter_name="default")
    if runtime.rank == 0:
        lengths = [len(r["input_ids"]) for r in encoded]
        result = {
            "world_size": runtime.world_size,
            "steps": steps,
            "lengths": lengths,
            "logps": logps.tolist(),
            "eval": {k: evaluation[k] for k in ("loss", "samples", "tokens")} if not args.mixed else None,
        }
        Path(args.out, "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    twinkle.runtime.shutdown()
