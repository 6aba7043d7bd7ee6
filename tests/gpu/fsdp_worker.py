"""One accumulation window of a kernelized tiny model on Twinkle's own FSDP2 path: packed rows,
the fused linear cross-entropy, Muon through ``ReplicatedOptimizer``, and a last micro-batch of
one row, so that in a world of two ranks one rank's share is empty and it runs the pad batch.

``train`` returns the updated LoRA weights at full size; the tests compare a sharded run with an
unsharded one, which must give the same update (the step is the mean over every supervised token
of the global batch, whatever the sharding). Run as a script (plainly, or under
``torchrun --nproc-per-node N``) it writes each rank's result to ``OUT/rank<R>.pt``."""

import argparse
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig

from twinkle.dataset import Dataset, DatasetMeta
from twinkle.kernel import kernelize
from twinkle.model import TransformersModel
from twinkle.model.forward import causal_lm_of
from twinkle.preprocessor import SelfCognitionProcessor
from twinkle.template.base import IGNORE_INDEX

ROWS = 9  # two micro-batches: 8 rows, then 1 (an empty share on every rank but the first)
FILL = {"input_ids": 0, "labels": IGNORE_INDEX, "attention_mask": 0, "position_ids": 0}


def global_batch(model_dir: Path) -> dict[str, torch.Tensor]:
    """The same padded batch of ``ROWS`` rows on every rank (the data loader would hand each
    rank its own share)."""
    dataset = Dataset(DatasetMeta(None, data_slice=range(ROWS)))
    dataset.set_template("Template", model_id=str(model_dir), max_length=128)
    dataset.map(SelfCognitionProcessor("Twinkle", "Acme"))
    dataset.encode()
    rows = [dataset[i] for i in range(ROWS)]
    width = max(len(r["input_ids"]) for r in rows)
    batch = {k: torch.full((ROWS, width), fill, dtype=torch.long) for k, fill in FILL.items()}
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        batch["input_ids"][i, :n] = torch.tensor(row["input_ids"])
        batch["labels"][i, :n] = torch.tensor(row["labels"])
        batch["attention_mask"][i, :n] = 1
        batch["position_ids"][i, :n] = torch.arange(n)
    return batch


def share(batch: dict[str, torch.Tensor], start: int, stop: int, rank: int, world: int) -> dict[str, Any]:
    """This rank's contiguous share of rows ``start:stop`` (empty where the rows run out)."""
    per_rank = -(-(stop - start) // world)
    lo = min(stop, start + rank * per_rank)
    hi = min(stop, lo + per_rank)
    return {k: v[lo:hi] for k, v in batch.items() if torch.is_tensor(v)}


def spread_norms(model: torch.nn.Module) -> None:
    """Norm weights away from 1 (seeded), so that a kernel ignoring them shows."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                noise = torch.randn(param.shape, generator=generator) * 0.2 + 1.0
                param.copy_(noise.to(param.device, param.dtype))


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().cpu().clone()


def train(model_dir: Path, rank: int = 0, world: int = 1, shard_one_rank: bool = False) -> dict[str, Any]:
    """The window on this rank. ``shard_one_rank``: shard the model over a 1-rank mesh (a process
    group must exist), as ``add_adapter_to_model`` does itself in a world of 2 or more."""
    from twinkle.distributed import DeviceMesh
    from twinkle.distributed.fsdp import apply_fsdp2

    batch = global_batch(model_dir)
    model = TransformersModel(str(model_dir), dtype=torch.bfloat16, padding_free=True)
    spread_norms(model.model)
    kernelize(model)
    torch.manual_seed(0)  # the same LoRA initialisation in every run and on every rank
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    model.add_adapter_to_model("default", config, gradient_accumulation_steps=2)
    if shard_one_rank:
        lm = causal_lm_of(model.model)
        apply_fsdp2(lm, DeviceMesh(fsdp_size=1, dp_size=1), model.device, lm._no_split_modules)
    model.set_optimizer("Muon", lr=1e-2, adjust_lr_fn="match_rms_adamw")
    lora = {n: p for n, p in model.model.named_parameters() if p.requires_grad}
    initial = {n: full(p) for n, p in lora.items()}
    shares = [share(batch, 0, 8, rank, world), share(batch, 8, ROWS, rank, world)]
    losses = [model.forward_backward(inputs=s, task="fused_lm_ce") for s in shares]
    group = model.optimizer_group["default"]
    stepped = model.clip_grad_and_step()
    return {
        "rows": [int(s["input_ids"].shape[0]) for s in shares],
        "losses": losses,
        "stepped": stepped,
        "grad_norm": float(group.last_grad_norm),
        "optimizer": type(group.optimizer.optimizer).__name__,
        "replicated": not group.optimizer.direct,
        "sharded": any(type(p).__name__ == "DTensor" for p in lora.values()),
        "initial": initial,
        "updated": {n: full(p) for n, p in lora.items()},
    }


def main() -> None:
    from twinkle.runtime import initialize
    from twinkle.runtime.runtime import shutdown

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    runtime = initialize()
    result = train(args.model_dir, runtime.rank, runtime.world_size)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(result, args.out / f"rank{runtime.rank}.pt")
    shutdown()


if __name__ == "__main__":
    main()
