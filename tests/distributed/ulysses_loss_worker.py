"""A few LoRA steps of an RL or preference loss on one fixed batch, for
``test_ulysses_rl_losses.py``.

Run it as one process, or under torchrun with ``--ulysses-size 2``: both ranks read every row and
each runs half of the positions. ``--loss``:

- ``grpo``/``gspo``/``ppo``: 4 chat samples of unequal length (one longer than half the packed
  row, so it straddles the ranks' shares), each with a row advantage and the sampler's per-token
  log-probabilities (the policy's own before the first step, moved by a fixed noise, so ratios
  differ from 1 and some clip); GRPO and GSPO with a KL term to the base model
  (``ref_outputs``); PPO's advantage per token;
- ``dpo``: 4 pairs interleaved [chosen, rejected, ...], the first chosen answer long, against
  the base model (``ref_outputs``), with an SFT term and ``DPOMetric`` (it reads the step's
  logps of every row);
- ``gkd``: the 4 chat samples with a teacher's top-8 log-probabilities and token ids at every
  position (random, fixed by a seed: each position's 8 distinct ids hold 0.9 of the mass).

Each step: the reference pass, ``forward_backward``, the gradient rescaled to the step's mean
(``clip_grad_norm(0)``: measured, not clipped), the optimizer step, the metrics. Rank 0 writes
``OUT/result.json`` (per step the loss, gradient norm and counts; the world size; the samples'
lengths) and ``OUT/grads.pt`` (every LoRA weight's gradient of the first
step, full size); every rank writes its last step's logps (``OUT/logps-RANK.json``)."""

import argparse
import json
from pathlib import Path

import torch
from peft import LoraConfig
from sp_worker import QUESTIONS, rows

import twinkle
from twinkle import DeviceMesh
from twinkle.dataloader import collate
from twinkle.loss.ppo import PPOLoss
from twinkle.metric import DPOMetric
from twinkle.model import TransformersModel

PAIRS = [
    ("Who are you?", "I am Twinkle, a helpful assistant made by Acme. " * 14, "I am a robot."),
    ("What is your name?", "Twinkle", "ModelScope"),
    ("Who made you?", "Acme made me.", "I was made in Paris France."),
    ("Are you a helpful assistant?", "Yes, I am Twinkle, a helpful assistant.", "No"),
]
LOSSES = {
    "grpo": ("GRPOLoss", {"epsilon": 0.2, "beta": 0.04}),
    "gspo": ("GSPOLoss", {"epsilon": 0.05, "epsilon_high": 0.05, "beta": 0.04}),
    "ppo": (PPOLoss, {}),  # not a registered name: the class
    "dpo": ("DPOLoss", {"beta": 0.1, "sft_weight": 0.1}),
    "gkd": ("GKDLoss", {"beta": 0.5, "topk": 8}),
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-id", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--loss", choices=sorted(LOSSES), required=True)
    p.add_argument("--ulysses-size", type=int, default=None)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--padded", action="store_true")
    args = p.parse_args()
    mesh = DeviceMesh.from_sizes(ulysses_size=args.ulysses_size)
    runtime = twinkle.initialize(mode="local", global_device_mesh=mesh, timeout_s=30)
    model = TransformersModel(model_id=args.model_id, dtype=torch.float32, padding_free=not args.padded)
    layers = {type(m).__name__ for m in model.model.modules() if type(m).__name__.endswith("DecoderLayer")}
    model.model._no_split_modules = sorted(layers)
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    lora.init_lora_weights = False  # B random too: every LoRA weight has a gradient at the first step
    model.add_adapter_to_model("default", lora)
    model.set_optimizer("AdamW", lr=1e-2)
    loss, options = LOSSES[args.loss]
    model.set_loss(loss, **options)
    if args.loss == "dpo":  # reads the step's logps of every row
        model.add_metric(DPOMetric, beta=0.1)
    if args.loss == "dpo":
        questions = [(q, a) for q, chosen, rejected in PAIRS for a in (chosen, rejected)]
    else:
        questions = QUESTIONS
    encoded = rows(model.tokenizer, questions)
    batch = collate(encoded, model.tokenizer.pad_token_id)  # every rank reads every row
    keywords = {}
    if args.loss == "gkd":
        teacher = torch.Generator().manual_seed(2)
        shape = (*batch["input_ids"].shape, 8)
        vocab = model.model.get_input_embeddings().weight.shape[0]
        keywords["teacher_topk_logprobs"] = torch.log_softmax(torch.randn(shape, generator=teacher), -1) - 0.1
        ids = torch.rand((*shape[:2], vocab), generator=teacher).argsort(-1)  # distinct at each position
        keywords["teacher_topk_indices"] = ids[..., :8]
    elif args.loss != "dpo":
        own = model.forward_only(inputs=batch)["logps"]
        noise = torch.Generator().manual_seed(1)
        keywords["old_logps"] = own + 0.1 * torch.randn(own.shape, generator=noise)
        advantages = torch.tensor([1.0, -0.5, 0.8, -1.2])
        if args.loss == "ppo":  # per token: the row's advantage moved by a fixed noise
            advantages = advantages[:, None] + 0.5 * torch.randn(own.shape, generator=noise)
        keywords["advantages"] = advantages
    names = {id(p): n for n, p in model.model.named_parameters()}
    group = model._group(None)
    steps, grads = [], {}
    for step in range(args.steps):
        if args.loss not in ("ppo", "gkd"):
            keywords["ref_outputs"] = model.forward_only(inputs=batch, disable_lora=True)
        out = model.forward_backward(inputs=batch, **keywords)
        model.clip_grad_norm(0)  # the gradients rescaled to the step's mean; measured only
        if step == 0:
            for param, copy in zip(group.optimizer.params, group.optimizer.copies, strict=True):
                grads[names[id(param)]] = copy.grad.detach().clone()
        model.step()
        model.zero_grad()
        metric = model.calculate_metric(is_training=True)
        steps.append({k: v for k, v in metric.items() if isinstance(v, int | float)})
        steps[-1]["rank_tokens"] = out.get("num_tokens")
        logps = out.get("logps")
    # every rank's step logps cover the whole batch
    Path(args.out, f"logps-{runtime.rank}.json").write_text(json.dumps(logps.tolist()))
    if runtime.rank == 0:
        result = {
            "world_size": runtime.world_size,
            "steps": steps,
            "lengths": [len(r["input_ids"]) for r in encoded],
        }
        Path(args.out, "result.json").write_text(json.dumps(result))
        torch.save(grads, Path(args.out, "grads.pt"))


if __name__ == "__main__":
    main()
    twinkle.runtime.shutdown()
