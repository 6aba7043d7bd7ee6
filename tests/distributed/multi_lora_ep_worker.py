"""Two adapters with LoRA on a mixture-of-experts model's experts, for ``test_multi_lora_ep.py``.

Run as one process, or under torchrun with ``--ep-size N`` (FSDP2 over every rank, each rank
holding num_experts / N experts and reading its share of the 4 chat samples).

``--mode multi``: a ``MultiLoraTransformersModel`` in upstream's cookbook shape (the slots'
``lora_config`` without ``target_parameters``; each adapter names them, so the first one attaches
the expert slots before the model is placed): adapters ``a`` and ``b`` are added, saved as they
start (``OUT/init-a``, ``OUT/init-b``), then trained interleaved a, b, a, b, ... and saved
(``OUT/final-a``, ``OUT/final-b``). ``--mode solo --adapter NAME --init-folder FOLDER``: adapter NAME's
config alone on a plain ``TransformersModel``, loaded from FOLDER, trained the same steps and
saved (``OUT/final-NAME``). Rank 0 writes ``OUT/result.json``: per adapter and step the loss and
gradient norm, the world size and the samples' lengths."""

import argparse
import json
from pathlib import Path

import torch
from peft import LoraConfig

import twinkle
from twinkle import DeviceMesh
from twinkle.dataloader import collate
from twinkle.model import MultiLoraTransformersModel, TransformersModel
from twinkle.template import get_template

STEPS, LR = 3, 1e-2
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
SLOTS = LoraConfig(r=8, lora_alpha=32, target_modules="all-linear", exclude_modules=["o_a_proj"])
ADAPTERS = {
    "a": dict(
        r=4,
        lora_alpha=8,
        target_modules="all-linear",
        exclude_modules=["o_a_proj"],
        target_parameters=EXPERTS,
    ),
    "b": dict(r=2, lora_alpha=4, target_modules=["q_b_proj"], target_parameters=["mlp.experts.gate_up_proj"]),
}
QUESTIONS = [
    ("Who are you?", "I am Twinkle, a helpful assistant made by Acme. " * 3),
    ("What is your name?", "Twinkle"),
    ("Who made you?", "Acme made me, in Paris France. " * 2),
    ("Are you a helpful assistant?", "Yes, I am Twinkle, a helpful assistant."),
]
KEYWORDS = dict(
    dtype=torch.float32,
    activation_checkpointing="off",
    fsdp_config={"expert_parallel": {"enabled": True, "router_dtype": "fp32", "keep_router_logits": False}},
)


def shard(model, mesh) -> tuple[dict, list[int]]:
    template = get_template("Template", model.tokenizer)
    encoded = [
        template.encode([{"role": "user", "content": q}, {"role": "assistant", "content": a}])
        for q, a in QUESTIONS
    ]
    share = len(encoded) // mesh.data_world_size
    mine = encoded[mesh.data_rank * share : (mesh.data_rank + 1) * share]
    return collate(mine, model.tokenizer.pad_token_id), [len(r["input_ids"]) for r in encoded]


def split_layers(model) -> None:
    layers = {type(m).__name__ for m in model.model.modules() if type(m).__name__.endswith("DecoderLayer")}
    model.model._no_split_modules = sorted(layers)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-id", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--ep-size", type=int, default=None)
    p.add_argument("--mode", choices=("multi", "solo"), required=True)
    p.add_argument("--adapter", default=None)
    p.add_argument("--init-folder", default=None)
    args = p.parse_args()
    mesh = DeviceMesh.from_sizes(ep_size=args.ep_size)
    runtime = twinkle.initialize(mode="local", global_device_mesh=mesh, timeout_s=60)
    if args.mode == "multi":
        model = MultiLoraTransformersModel(args.model_id, max_loras=2, max_r=8, lora_config=SLOTS, **KEYWORDS)
        split_layers(model)
        names = list(ADAPTERS)
        for name in names:
            model.add_adapter_to_model(name, LoraConfig(**ADAPTERS[name]))
        model._lazy_wrap_model()  # as upstream's cookbook places it: expert slots in, experts split
        for name in names:
            model.save(f"init-{name}", output_dir=args.out, adapter_name=name, save_optimizer=False)
    else:
        model = TransformersModel(model_id=args.model_id, **KEYWORDS)
        split_layers(model)
        names = [args.adapter]
        model.add_adapter_to_model(args.adapter, LoraConfig(**ADAPTERS[args.adapter]))
        model.load(args.init_folder, adapter_name=args.adapter)
    for name in names:
        model.set_optimizer("AdamW", lr=LR, adapter_name=name)
    batch, lengths = shard(model, mesh)
    window = {"gradient_accumulation_steps": 1} if args.mode == "multi" else {}  # the cookbook's keyword
    steps = {name: [] for name in names}
    for _ in range(STEPS):
        for name in names:
            model.forward_backward(inputs=batch, adapter_name=name, **window)
            model.clip_grad_and_step(adapter_name=name, **window)
            metric = model.calculate_metric(is_training=True, adapter_name=name)
            steps[name].append({k: metric[k] for k in ("loss", "grad_norm")})
    for name in names:
        model.save(f"final-{name}", output_dir=args.out, adapter_name=name, save_optimizer=False)
    if runtime.rank == 0:
        result = {"world_size": runtime.world_size, "steps": steps, "lengths": lengths}
        Path(args.out, "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    twinkle.runtime.shutdown()
