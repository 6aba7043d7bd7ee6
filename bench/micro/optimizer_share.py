"""The optimizer step's share of a training step, with the contract's Muon.

    python bench/micro/optimizer_share.py --workload W1 --batches 16

Runs the contract's configuration (``common.CONFIGS['contract']``: Muon with
``adjust_lr_fn='match_rms_adamw'``, LoRA r 8 on every linear layer, dropout 0.05) over the same
batches and times, per step, ``forward_backward`` and ``clip_grad_and_step`` apart (the latter:
the gradient norm, clipping, Muon's Newton-Schulz iterations and the update). Prints the medians
and the optimizer's share, then the same with AdamW for scale."""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import _paths  # noqa: F401  (puts bench/ and bench/harness on sys.path)
import torch
from common import build_dataset, profiled_model, sync
from run import WORKLOADS, prepare

import twinkle
from twinkle.dataloader import DataLoader


def measure(config: str, workload: str, batches: int, threads: int) -> tuple[float, float]:
    namespace = argparse.Namespace(
        steps=batches, warmup=2, seed=42, threads=threads, model="smollm2", tokenizer=None, dtype="auto",
        config=config,
    )  # fmt: skip
    spec = prepare(workload, namespace, Path(tempfile.mkdtemp(prefix="twinkle-opt-")))
    twinkle.initialize(seed=42)
    dataset = build_dataset(spec)
    model = profiled_model(spec)
    data = [b for _, b in zip(range(batches + 2), DataLoader(dataset=dataset, batch_size=4), strict=False)]
    passes, steps = [], []
    for index, batch in enumerate(data):
        start = time.perf_counter()
        model.forward_backward(inputs=batch, task="fused_lm_ce")
        sync()
        middle = time.perf_counter()
        model.clip_grad_and_step(max_grad_norm=1.0)
        sync()
        end = time.perf_counter()
        if index >= 2:  # after two warm-up steps
            passes.append(middle - start)
            steps.append(end - middle)
    return statistics.median(passes), statistics.median(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=[w for w in WORKLOADS if w != "contract"], default="W1")
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for config in ("contract", "adamw"):
        passes, step = measure(config, args.workload, args.batches, args.threads)
        print(
            f"{args.workload} {config}: forward+backward {passes:.3f} s, clip+optimizer step {step:.4f} s "
            f"({100 * step / (passes + step):.1f}% of the step; medians of {args.batches})",
            flush=True,
        )


if __name__ == "__main__":
    main()
