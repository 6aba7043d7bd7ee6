"""The single controller's costs (``twinkle.runtime.controller``): the driver's overhead per
``forward_backward``, and LoRA weight sync between two device groups.

    python bench/ray_controller.py --steps 20 --rounds 3 --out bench/results/ray-controller-MACHINE-DATE.md
    python bench/ray_controller.py --model tiny --steps 2 --rounds 1 --out /tmp/rc.md   # checks the script

A local Ray cluster holds two groups of one CPU rank each: ``model`` (``TransformersModel``,
LoRA r 8 on all linear layers, AdamW) and ``sampler`` (``TorchSampler`` with its own copy of
the model). The bundled SmolLM2-135M in fp32 unless ``--model`` says otherwise.

- ``overhead``: ``--steps`` calls of ``forward_backward`` on one W1 batch (4 self-cognition
  rows, max length 1024) made through the driver's proxy, against the same calls timed inside
  the worker (``RemoteObject.time_on_ranks``), alternating A/B then B/A over ``--rounds``;
  medians. Target: proxy / in-worker <= 1.05.
- ``sync``: ``CheckpointEngineManager(model, sampler).sync_weights()``, the adapter's LoRA
  weights from the model group's rank 0 through Ray's object store into the sampler's copy,
  ``--steps`` times; median seconds and MiB.
  Target on a CPU: <= 0.2 s.

Writes a markdown report to ``--out`` and prints it."""

import argparse
import datetime
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness  # noqa: F401  (puts bench/harness on sys.path)
import torch
from common import MODEL_AUTHOR, MODEL_NAME
from peft import LoraConfig
from shapes import CHOICES, model_path

import twinkle
from twinkle import DeviceGroup


def _batch(model_id: str | None) -> list[dict]:
    from twinkle.dataset import Dataset, DatasetMeta
    from twinkle.preprocessor import SelfCognitionProcessor

    dataset = Dataset(DatasetMeta(None, data_slice=range(4)))
    dataset.set_template("Template", model_id=model_id, max_length=1024)
    dataset.map(SelfCognitionProcessor(MODEL_NAME, MODEL_AUTHOR))
    dataset.encode()
    return [dataset[i] for i in range(4)]


def overhead(model: object, batch: list[dict], steps: int, rounds: int) -> dict[str, float]:
    proxy, inside = [], []
    model.forward_backward(inputs=batch)  # untimed: the first call builds the step's kernels
    model.time_on_ranks("forward_backward", batch, times=1)
    for r in range(rounds):
        order = ("proxy", "inside") if r % 2 == 0 else ("inside", "proxy")
        for side in order:
            if side == "proxy":
                start = time.perf_counter()
                for _ in range(steps):
                    model.forward_backward(inputs=batch)
                proxy.append((time.perf_counter() - start) / steps)
            else:
                inside.append(model.time_on_ranks("forward_backward", batch, times=steps) / steps)
            model.zero_grad()
    p, i = statistics.median(proxy), statistics.median(inside)
    return {"proxy_s": p, "inside_s": i, "ratio": p / i}


def sync(model: object, sampler: object, steps: int) -> dict[str, float]:
    from twinkle.checkpoint_engine import CheckpointEngineManager

    manager = CheckpointEngineManager(model, sampler)
    manager.sync_weights()  # untimed: the first adds the adapter to the sampler
    times, size = [], 0
    for _ in range(steps):
        start = time.perf_counter()
        size = manager.sync_weights()["bytes"]
        times.append(time.perf_counter() - start)
    return {"sync_s": statistics.median(times), "mib": size / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=CHOICES, default="smollm2", help="see bench/harness/shapes.py")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    opts = parser.parse_args()
    model_id = model_path(opts.model, Path(tempfile.gettempdir()) / "twinkle-bench-models", 42)
    groups = [DeviceGroup("model", 1, "CPU"), DeviceGroup("sampler", 1, "CPU")]
    twinkle.initialize(mode="ray", groups=groups)
    model = twinkle.model.TransformersModel(model_id, remote_group="model")
    model.add_adapter_to_model("default", LoraConfig(r=8, lora_alpha=32, target_modules="all-linear"))
    model.set_optimizer("AdamW", lr=1e-4)
    sampler = TorchSampler(model_id, remote_group="sampler")
    first = overhead(model, _batch(model_id), opts.steps, opts.rounds)
    second = sync(model, sampler, opts.steps)
    report = "\n".join(
        [
            f"# Single controller: driver overhead and weight sync ({opts.model})",
            "",
            f"- machine: {platform.processor() or platform.machine()}, python {sys.version.split()[0]}, "
            f"torch {torch.__version__}, {datetime.date.today()}",
            f"- command: `{' '.join([Path(sys.executable).name, *sys.argv])}`",
            "",
            "| measure | value | target |",
            "|---|---|---|",
            f"| forward_backward through the proxy | {first['proxy_s'] * 1e3:.1f} ms | |",
            f"| forward_backward inside the worker | {first['inside_s'] * 1e3:.1f} ms | |",
            f"| proxy / in-worker | {first['ratio']:.3f} | <= 1.05 |",
            f"| LoRA weight sync, model -> sampler ({second['mib']:.2f} MiB) | {second['sync_s'] * 1e3:.1f} ms | <= 200 ms |",
        ]
    )
    print(report)
    if opts.out:
        opts.out.write_text(report + "\n")


if __name__ == "__main__":
    import twinkle.model  # noqa: F401  (the model classes, after the harness set the path)
    from twinkle.sampler.torch_sampler import TorchSampler

    main()
