"""A few LoRA steps on one fixed batch of a mixture-of-experts model, for
``test_expert_parallel.py``.

Run it as one process, or under torchrun with ``--ep-size N`` (FSDP2 over every rank): each rank
holds num_experts / N experts and reads its share of the 4 chat samples. Each step:
forward_backward, clip_grad_and_step, the metrics. Rank 0 writes ``OUT/result.json`` (per step
the loss and gradient norm; the world size; the logps of an evaluation pass of rank 0's rows)
and the adapter saved after the last step (``OUT/adapter``); every rank writes
``OUT/experts-RANK.safetensors``, the expert weights it holds after the steps.
``--target-parameters`` puts LoRA on the experts too; ``--router-replay`` asks for routing replay;
``--full-parameter`` trains every weight (no adapter)."""

import argparse
import json
from pathlib import Path

import torch
from peft import LoraConfig
from safetensors.torch import save_file

import twinkle
from twinkle import DeviceMesh
from twinkle.dataloader import collate
from twinkle.model import TransformersModel
from twinkle.template import get_template

QUESTIONS = [
    ("Who are you?", "I am Twinkle, a helpful assistant made by Acme. " * 3),
    ("What is your name?", "Twinkle"),
    ("Who made you?", "Acme made me, in Paris France. " * 2),
    ("Are you a helpful assistant?", "Yes, I am Twinkle, a helpful assistant."),
]


def rows(tokenizer) -> list[dict]:
    template = get_template("Template", tokenizer)
    return [
        template.encode([{"role": "user", "content": q}, {"role": "assistant", "content": a}])
        for q, a in QUESTIONS
    ]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-id", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--ep-size", type=int, default=None)
    p.add_argument("--ulysses-size", type=int, default=None)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--target-parameters", action="store_true")
    p.add_argument("--router-replay", action="store_true")
    p.add_argument("--full-parameter", action="store_true")
    args = p.parse_args()
    mesh = DeviceMesh.from_sizes(ep_size=args.ep_size, ulysses_size=args.ulysses_size)
    runtime = twinkle.initialize(mode="local", global_device_mesh=mesh, timeout_s=30)
    model = TransformersModel(
        model_id=args.model_id,
        dtype=torch.float32,
        activation_checkpointing="off",
        enable_router_replay=args.router_replay,
        fsdp_config={"expert_parallel": {"enabled": True, "router_dtype": "fp32"}},
    )
    layers = {type(m).__name__ for m in model.model.modules() if type(m).__name__.endswith("DecoderLayer")}
    model.model._no_split_modules = sorted(layers)
    torch.manual_seed(0)
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if args.target_parameters else None
    # attention (DeepSeek-V4: its q_b_proj, o_b_proj), and the shared expert's gate where the family has
    # one (PEFT maps 'all-linear' and
    # the MLP names gate_proj, up_proj, down_proj onto the fused experts too)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "shared_expert_gate", "q_b_proj", "o_b_proj"]
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, target_parameters=experts)
    lora.init_lora_weights = False  # B random too: every LoRA weight has a gradient from the first step
    name = None if args.full_parameter else "default"
    if name is not None:
        model.add_adapter_to_model(name, lora)
    model.set_optimizer("AdamW", lr=1e-2, adapter_name=name)
    encoded = rows(model.tokenizer)
    share = len(encoded) // mesh.data_world_size
    mine = encoded[mesh.data_rank * share : (mesh.data_rank + 1) * share]
    batch = collate(mine, model.tokenizer.pad_token_id)
    steps = []
    for _ in range(args.steps):
        model.forward_backward(inputs=batch, adapter_name="default")
        model.clip_grad_and_step(adapter_name="default")
        metric = model.calculate_metric(is_training=True, adapter_name="default")
        steps.append({k: metric[k] for k in ("loss", "grad_norm", "samples", "supervised_tokens")})
    model.save("adapter", output_dir=args.out, adapter_name="default", save_optimizer=False)
    logps = model.forward_only(inputs=collate(encoded[:share], model.tokenizer.pad_token_id))["logps"]
    named = {  # under the Hugging Face model's names
        name.replace("base_model.model.", "").replace(".base_layer", ""): param
        for name, param in model.model.named_parameters()
    }
    held = {  # the experts' own weights and biases (their LoRA weights are FSDP2's shards)
        name: param.detach().contiguous()
        for name, param in named.items()
        if name.endswith(("experts.gate_up_proj", "experts.down_proj", "_proj_bias")) and ".experts." in name
    }
    save_file(held, str(Path(args.out, f"experts-{runtime.rank}.safetensors")))
    if runtime.rank == 0:
        lengths = [len(r["input_ids"]) for r in encoded]
        result = {
            "world_size": runtime.world_size,
            "steps": steps,
            "logps": logps.tolist(),
            "lengths": lengths,
        }
        Path(args.out, "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    twinkle.runtime.shutdown()
