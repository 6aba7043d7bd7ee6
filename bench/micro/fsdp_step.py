"""FSDP2 on CPU: per-step time of 1 vs N processes, and the Muon step on sharded LoRA weights.

    python bench/fsdp_step.py                      # 1 process
    python -m torch.distributed.run --nproc_per_node 2 bench/fsdp_step.py --fsdp-size 2

Prints (rank 0) the median seconds of forward+backward, of the optimizer step through our
ReplicatedOptimizer (gather, Muon on whole matrices, scatter), and, when sharded, of torch's
Muon stepping the sharded DTensor parameters directly (what a plain FSDP2 + Muon script does).
Global batch 4 of the bundled self-cognition rows on the bundled SmolLM2-135M, LoRA r=8
on all linear layers, fp32, 2 threads per machine."""

import argparse
import json
import statistics
import time

import _paths  # noqa: F401  (puts bench/ and bench/harness on sys.path)
import torch
from peft import LoraConfig

import twinkle
from twinkle import DeviceMesh
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.model import TransformersModel
from twinkle.model.lora import trainable_parameters
from twinkle.preprocessor import SelfCognitionProcessor
from twinkle.runtime import get_runtime


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fsdp-size", type=int, default=None)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    rt = twinkle.initialize(global_device_mesh=DeviceMesh.from_sizes(fsdp_size=args.fsdp_size))
    torch.set_num_threads(max(1, 2 // rt.world_size))
    ds = Dataset(DatasetMeta(None, data_slice=range(4 * (args.steps + 1))))
    ds.set_template("Template", max_length=1024).map(SelfCognitionProcessor("Twinkle", "Acme")).encode()
    batches = list(DataLoader(ds, batch_size=4))
    model = TransformersModel(None)
    model.model._no_split_modules = ["LlamaDecoderLayer"]
    model.add_adapter_to_model(
        "default", LoraConfig(r=8, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)
    )
    model.set_optimizer(torch.optim.Muon, lr=1e-4, adjust_lr_fn="match_rms_adamw")

    fwd_bwd, steps = [], []
    for batch in batches[: args.steps]:
        t0 = time.perf_counter()
        model.forward_backward(inputs=batch)
        t1 = time.perf_counter()
        model.clip_grad_and_step()
        fwd_bwd.append(t1 - t0)
        steps.append(time.perf_counter() - t1)
    result = {
        "world_size": rt.world_size,
        "forward_backward_s": statistics.median(fwd_bwd[1:]),
        "replicated_muon_step_s": statistics.median(steps[1:]),
    }
    if rt.world_size > 1:
        # What FSDP2 + torch Muon does without us: Newton-Schulz on the sharded DTensors.
        model.forward_backward(inputs=batches[-1])
        params = trainable_parameters(model.model)
        sharded = torch.optim.Muon(params, lr=1e-4, adjust_lr_fn="match_rms_adamw")
        result["dtensor_muon_step_s"] = median_time(sharded.step, 2)
    if get_runtime().is_main:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
