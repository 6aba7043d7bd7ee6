"""One full-parameter step of a tiny Qwen3-MoE whose config asks for the router's load-balancing
loss, for ``test_router_aux_ulysses.py``.

Run it as one process, or under torchrun with ``--ulysses-size 2``: both ranks read the 4 chat
samples (one longer than half the packed row, so it straddles the ranks' shares) and each routes
its half of the positions. The step: ``forward_backward``, the gradients rescaled to the step's
mean (``clip_grad_norm(0)``: measured, not clipped), the metrics. Rank 0 writes
``OUT/result.json`` (the step's loss and ``aux_loss``, the metrics' ``loss``, ``aux_loss`` and
``grad_norm``, the world size, the samples' lengths) and ``OUT/grads.pt`` (every weight's
gradient, full size). ``--padded`` runs the padded batch instead of the packed row."""

import argparse
import json
from pathlib import Path

import torch
from sp_worker import QUESTIONS, rows

import twinkle
from twinkle import DeviceMesh
from twinkle.dataloader import collate
from twinkle.model import TransformersModel


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-id", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--ulysses-size", type=int, default=None)
    p.add_argument("--padded", action="store_true")
    args = p.parse_args()
    mesh = DeviceMesh.from_sizes(ulysses_size=args.ulysses_size)
    runtime = twinkle.initialize(mode="local", global_device_mesh=mesh, timeout_s=60)
    model = TransformersModel(
        model_id=args.model_id,
        dtype=torch.float32,
        padding_free=not args.padded,
        activation_checkpointing="off",
    )
    model.set_optimizer("AdamW", lr=1e-3)  # no adapter: every weight trains
    encoded = rows(model.tokenizer, QUESTIONS)
    batch = collate(encoded, model.tokenizer.pad_token_id)  # every rank reads every row
    out = model.forward_backward(inputs=batch)
    model.clip_grad_norm(0)  # the gradients rescaled to the step's mean; measured only
    grads = {}
    for name, param in model.model.named_parameters():  # a collective per sharded weight
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        grads[name] = grad.detach().clone()
    model.step()
    model.zero_grad()
    metrics = model.calculate_metric(is_training=True)
    if runtime.rank == 0:
        result = {
            "world_size": runtime.world_size,
            "loss": float(out),
            "aux_loss": out.get("aux_loss"),
            "metrics": {k: metrics[k] for k in ("loss", "aux_loss", "grad_norm")},
            "lengths": [len(r["input_ids"]) for r in encoded],
        }
        Path(args.out, "result.json").write_text(json.dumps(result))
        torch.save(grads, Path(args.out, "grads.pt"))


if __name__ == "__main__":
    main()
    twinkle.runtime.shutdown()
