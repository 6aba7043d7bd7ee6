"""One full-parameter step of a tiny Qwen3-MoE whose config asks for the router's load-balancing
loss, for ``test_router_aux_distributed.py``.

Run it as one process, or under torchrun with ``--ulysses-size 2``: both ranks read the 4 chat
samples (one longer than half the packed row, so it straddles the ranks' shares) and each routes
its half of the positions. The step: ``forward_backward``, the gradients rescaled to the step's
mean (``clip_grad_norm(0)``: measured, not clipped), the metrics. Rank 0 writes
``OUT/result.json`` (the step's loss and ``aux_loss``, the metrics' ``loss``, ``aux_loss`` and
``grad_norm``, the world size, the samples' lengths) and ``OUT/grads.pt`` (every weight's
gradient, full size). ``--padded`` runs the padded batch instead of the packed row.

``--halves``: two micro-batches of other rows, with 8 targets each (``half``); one process runs
both in one accumulation window, 2 ranks (data parallel, FSDP2) one each."""

import argparse
import json
from pathlib import Path

import torch
from sp_worker import QUESTIONS, rows

import twinkle
from twinkle import DeviceMesh
from twinkle.dataloader import collate
from twinkle.model import TransformersModel


def half(index: int) -> dict[str, torch.Tensor]:
    """Micro-batch ``index`` of ``--halves``: rows of random tokens whose positions 8 to the
    second to last are supervised (``length - 9`` targets a row: 8 in either micro-batch)."""
    g = torch.Generator().manual_seed(index + 1)
    lengths = ((17,), (13, 13))[index]
    width = max(lengths)
    batch = {
        k: torch.zeros(len(lengths), width, dtype=torch.long)
        for k in ("input_ids", "attention_mask", "position_ids")
    }
    batch["labels"] = torch.full((len(lengths), width), -100)
    for i, n in enumerate(lengths):
        batch["input_ids"][i, :n] = torch.randint(1, 500, (n,), generator=g)
        batch["attention_mask"][i, :n] = 1
        batch["position_ids"][i, :n] = torch.arange(n)
        batch["labels"][i, 8 : n - 1] = batch["input_ids"][i, 8 : n - 1]
    return batch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-id", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--ulysses-size", type=int, default=None)
    p.add_argument("--padded", action="store_true")
    p.add_argument("--halves", action="store_true")
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
    batches = [collate(encoded, model.tokenizer.pad_token_id)]  # every rank reads every row
    if args.halves:
        batches = [half(mesh.data_rank)] if runtime.world_size > 1 else [half(0), half(1)]
    for batch in batches:
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
