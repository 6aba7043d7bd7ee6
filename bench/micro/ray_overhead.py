"""What ``--mode ray`` costs against torchrun: start-up and per-step time, on the same run.

    python bench/micro/ray_overhead.py                     # 2 ranks, the bundled model, 12 steps
    python bench/micro/ray_overhead.py --steps 20 --rounds 2

Runs the contract script (``cookbook/transformers/fsdp2.py --fsdp-size 2``) three ways: under
torchrun, with ``--mode ray`` starting its own local cluster, and with ``--mode ray`` joining a
cluster started beforehand (``ray start --head``). Each line the job prints is stamped as it
arrives; start-up is the time from launch to the first step's log line, a step the mean time
between the first and the last step's lines, and the end the time from the last step's line to
the process's exit (the last checkpoint and the teardown)."""

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "cookbook" / "transformers" / "fsdp2.py"
STEP = re.compile(r"Current is step (\d+) of")
RAY = str(Path(sys.executable).with_name("ray"))


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _timed(command: list[str], env: dict[str, str]) -> dict[str, float]:
    start = time.monotonic()
    steps: list[float] = []
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail = []
    for line in proc.stdout:
        tail = [*tail[-20:], line]
        if STEP.search(line):
            steps.append(time.monotonic())
    code = proc.wait()
    end = time.monotonic()
    if code != 0 or len(steps) < 2:
        raise SystemExit(f"{command[:4]} failed ({code}):\n{''.join(tail)}")
    return {
        "start-up s": steps[0] - start,
        "s/step": (steps[-1] - steps[0]) / (len(steps) - 1),
        "end s": end - steps[-1],
        "wall s": end - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="twinkle-ray-bench-"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    flags = [
        *("--fsdp-size", "2", "--train-samples", str(4 * args.steps), "--batch-size", "4"),
        *("--eval-interval", "100000", "--log-interval", "1", "--lora-dropout", "0"),
    ]
    port = _port()
    subprocess.run(
        [RAY, "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
         f"--temp-dir=/tmp/twb-{os.getpid()}", "--disable-usage-stats"],
        check=True, capture_output=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )  # fmt: skip
    ways = {
        "torchrun": lambda out: [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_port", str(_port()), str(SCRIPT), *flags, "--output-dir", out,
        ],
        "ray, own local cluster": lambda out: [sys.executable, str(SCRIPT), "--mode", "ray", *flags, "--output-dir", out],
        "ray, running cluster": lambda out: [
            sys.executable, str(SCRIPT), "--mode", "ray", *flags, "--output-dir", out,
            "--ray-address", f"127.0.0.1:{port}",
        ],
    }  # fmt: skip
    results: dict[str, list[dict[str, float]]] = {name: [] for name in ways}
    try:
        for r in range(args.rounds):
            for name, command in ways.items():
                out = work / f"{r}-{name.replace(' ', '_').replace(',', '')}"
                results[name].append(_timed(command(str(out)), env))
                shutil.rmtree(out, ignore_errors=True)
    finally:
        subprocess.run([RAY, "stop", "--force"], capture_output=True)
    columns = list(next(iter(results.values()))[0])
    print(
        f"\n{args.steps} steps of SmolLM2-135M, FSDP2 over 2 gloo ranks, median of {args.rounds} round(s)\n"
    )
    print("| launcher | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for name, rows in results.items():
        cells = [f"{statistics.median(row[c] for row in rows):.2f}" for c in columns]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
