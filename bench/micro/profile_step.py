"""Where a Twinkle training step goes: torch.profiler over a few steps of a workload.

    python bench/profile_step.py --workload W1 --steps 4
    python bench/profile_step.py --workload W2 --steps 1 --memory
    python bench/profile_step.py --workload W1 --steps 10 --python

Runs the Twinkle side of ``run.py`` (same data, model, adapter and loss) and prints the ops by
self CPU time; ``--memory`` prints the peak memory instead (CPU: ``ru_maxrss``; CUDA: the
allocator's peak and what is alive then, by allocating line, ``gpu_peak.py``), and ``--python``
the Python functions by cumulative time (where the host's time goes when the device waits on it)."""

import argparse
import cProfile
import pstats
import resource
import sys
import tempfile
import time
from pathlib import Path

import _paths  # noqa: F401  (puts bench/ and bench/harness on sys.path)
import torch
from common import build_dataset, profiled_model, sync, use_cuda
from gpu_peak import print_peak
from run import WORKLOADS, prepare
from shapes import CHOICES

import twinkle
from twinkle.dataloader import DataLoader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=list(WORKLOADS), default="W1")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--shapes", action="store_true", help="group the ops by input shape")
    parser.add_argument(
        "--python", action="store_true", help="cProfile instead: the Python functions, the host's share"
    )
    parser.add_argument("--model", choices=CHOICES, default="smollm2")
    parser.add_argument("--tokenizer", help="with a random --model: a folder of tokenizer files")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = Path(tempfile.mkdtemp(prefix="twinkle-profile-"))
    spec = prepare(
        args.workload,
        argparse.Namespace(
            steps=args.steps,
            warmup=args.warmup,
            seed=42,
            threads=args.threads,
            model=args.model,
            tokenizer=args.tokenizer,
            dtype=args.dtype,
        ),
        folder,
    )
    twinkle.initialize(seed=42)
    dataset = build_dataset(spec)
    model = profiled_model(spec)
    batches = iter(DataLoader(dataset=dataset, batch_size=4))

    def step() -> None:
        model.forward_backward(inputs=next(batches), task="fused_lm_ce")
        model.clip_grad_and_step(max_grad_norm=1.0)
        sync()

    for _ in range(args.warmup):
        step()
    if args.memory:
        if use_cuda():  # the allocator's history, to say what is alive at the peak (gpu_peak.py)
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.memory._record_memory_history(stacks="python", max_entries=2_000_000)
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"{args.steps} steps {time.perf_counter() - start:.2f} s, peak RSS {rss:.0f} MiB")
        if use_cuda():
            print(f"peak GPU memory allocated: {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")
            print_peak(torch.cuda.memory._snapshot(), before, args.rows)
            torch.cuda.memory._record_memory_history(enabled=None)
        return
    if args.python:
        profile = cProfile.Profile()
        profile.runcall(lambda: [step() for _ in range(args.steps)])
        pstats.Stats(profile).sort_stats("cumulative").print_stats(args.rows)
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if use_cuda():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=args.shapes) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        elapsed = time.perf_counter() - start
    print(f"{args.steps} steps in {elapsed:.2f} s (profiled)", file=sys.stderr)
    table = prof.key_averages(group_by_input_shape=args.shapes)
    print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if use_cuda():
        print(table.table(sort_by="self_cuda_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
