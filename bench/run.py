"""Twinkle against the usual route (Hugging Face ``Trainer`` + PEFT LoRA), on the same work.

    python bench/run.py --workload all            # W1 then W2, both sides each
    python bench/run.py --workload W1 --steps 32 --warmup 3 --out output/bench-results.json
    python bench/run.py --workload all --config adamw   # AdamW, constant lr, no dropout

For each workload this encodes the samples once with the Twinkle pipeline, then runs, back to
back, each side in its own process (``twinkle_side.py``, ``trainer_side.py``) on the same
samples in the same order, from the same weights and LoRA initialisation, for ``warmup + steps``
optimizer steps of batch 4, with the same optimizer, schedule and LoRA dropout (``--config``;
by default the contract script's). With dropout the two sides draw different masks (PEFT's
``nn.Dropout`` against Twinkle's in-node masks), so their losses agree in distribution, not
bit for bit. It prints a markdown table and writes a JSON file with every step.

Columns (steady state: the steps after the warm-up, timed from the end of the last warm-up step
to the end of the last step, so data loading and logging count):

- tokens/s: non-pad tokens per second; supervised tokens/s: positions whose next token is a
  label (what the loss is over).
- s/step: the steady-state time divided by ``steps``.
- peak RSS: the side's process peak resident memory (``VmHWM``, model loading included).
- final loss: mean of the last ``LOSS_STEPS`` per-step losses (same samples on both sides).
- model GFLOP/s and % of peak: the FLOPs the side executes (``flops.py``) over the steady-state
  time, against a fp32 (CPU, ``--threads`` threads) or bf16 (CUDA) matmul loop timed in this run.

FLOPs of a step (details and what is left out: ``flops.py``):

    P_body * (4 * N_frozen + 6 * N_lora) + P_head * 4 * V * H + 12 * L * d_attn * S

``P_body`` positions through the decoder (Trainer: pads included; Twinkle: the packed row), ``N_frozen`` frozen linear weights
(forward 2N, activation gradients 2N, no weight gradients), ``N_lora`` LoRA weights (6N),
``P_head`` positions the LM head runs on (Twinkle: supervised positions only; Trainer: all),
``V x H`` the head (frozen, tied), ``S`` causal (query, key) pairs over the padded width,
``L`` layers, ``d_attn`` query heads x head size."""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from statistics import mean, median

import harness  # noqa: F401  (puts bench/harness on sys.path)
import torch
from common import CONFIGS, Spec, build_dataset, resolve_dtype, write_encoded
from flops import matmul_peak_gflops, step_flops
from long_rows import write_long_rows
from shapes import CHOICES, model_path

HERE = Path(__file__).resolve().parent
SIDES = {"twinkle": HERE / "harness" / "twinkle_side.py", "hf_trainer": HERE / "harness" / "trainer_side.py"}
SCRIPT_SIDE = HERE / "harness" / "contract_side.py"  # the contract workload's Twinkle side
LOSS_STEPS = 4


@dataclass(frozen=True)
class Workload:
    long_rows: bool  # False: the bundled self-cognition rows
    max_length: int
    default_steps: int
    script: bool = False  # the Twinkle side is the verbatim contract script (contract_side.py)


# "contract" is W1's rows with the Twinkle side the contract script itself, unchanged.
WORKLOADS = {
    "W1": Workload(long_rows=False, max_length=1024, default_steps=32),
    "W2": Workload(long_rows=True, max_length=1024, default_steps=8),
    "contract": Workload(long_rows=False, max_length=1024, default_steps=32, script=True),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workload",
        choices=[*WORKLOADS, "all"],
        default="W1",
        help="all: W1, W2 and contract (the verbatim contract script against the Trainer on W1's rows)",
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default: W1 32, W2 8)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {', '.join(SIDES)}")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--model",
        choices=CHOICES,
        default="smollm2",
        help="the bundled SmolLM2-135M (default), or a seeded random model built from a config (shapes.py)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="with a random --model: a folder holding only tokenizer files (default: the bundled model's)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the sides this many times, alternating which goes first; the ratio is the median of the rounds",
    )
    parser.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="both sides' precision: auto (bf16 on CUDA, fp32 on CPU), or force one; bfloat16 on a CPU "
        "is the Trainer's bf16 autocast against Twinkle's bf16 weights",
    )
    parser.add_argument(
        "--config",
        choices=list(CONFIGS),
        default="contract",
        help="how both sides train: contract (the contract script's defaults: Muon, cosine schedule, "
        "LoRA dropout 0.05) or adamw (AdamW at a constant 1e-4, dropout 0)",
    )
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", type=Path, default=Path("output") / "bench-results.json")
    args = parser.parse_args()
    args.sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    unknown = [s for s in args.sides if s not in SIDES]
    if unknown or not args.sides:
        parser.error(f"--sides: unknown {unknown}; valid: {', '.join(SIDES)}")
    if args.config != "contract" and args.workload in ("contract", "all"):
        parser.error("the contract workload runs the script's own defaults: use --config contract")
    if args.warmup < 0 or (args.steps is not None and args.steps < 1) or args.rounds < 1:
        parser.error("need --warmup >= 0, --steps >= 1 and --rounds >= 1")
    return args


def prepare(name: str, args: argparse.Namespace, folder: Path) -> Spec:
    """Write the workload's rows (W2) and its Twinkle-encoded samples; return the run spec."""
    workload = WORKLOADS[name]
    steps = args.steps or workload.default_steps
    num_samples = 4 * (args.warmup + steps)
    path = model_path(getattr(args, "model", "smollm2"), folder, args.seed, getattr(args, "tokenizer", None))
    dataset_id = None
    if workload.long_rows:  # sized by the model's own tokenizer (a random shape's folder holds one)
        rows = folder / f"{name}_rows.jsonl"
        dataset_id = str(write_long_rows(rows, num_samples, seed=args.seed, tokenizer_path=path))
    spec = Spec(
        workload=name,
        dataset_id=dataset_id,
        num_samples=num_samples,
        max_length=workload.max_length,
        steps=steps,
        warmup=args.warmup,
        encoded_path=str(folder / f"{name}_encoded.jsonl"),
        seed=args.seed,
        threads=args.threads,
        dtype=getattr(args, "dtype", "auto"),
        model_path=path,
        config=getattr(args, "config", "contract"),
    )
    write_encoded(build_dataset(spec), Path(spec.encoded_path))
    return spec


def run_side(side: str, spec: Spec, folder: Path, threads: int) -> dict:
    spec_path, out_path = folder / f"{spec.workload}_spec.json", folder / f"{spec.workload}_{side}.json"
    spec.save(spec_path)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    print(f"== {spec.workload} {side}: {spec.warmup} warm-up + {spec.steps} timed steps", flush=True)
    start = time.perf_counter()
    path = SCRIPT_SIDE if side == "twinkle" and WORKLOADS[spec.workload].script else SIDES[side]
    subprocess.run([sys.executable, str(path), str(spec_path), str(out_path)], check=True, env=env)
    result = json.loads(out_path.read_text())
    result["process_seconds"] = time.perf_counter() - start
    return result


def summarize(result: dict, warmup: int, peak_gflops: float) -> dict:
    """Steady-state numbers of one side from its per-step records."""
    steps = result["steps"]
    timed = steps[warmup:]
    start = steps[warmup - 1]["end"] if warmup else steps[0]["begin"]
    elapsed = steps[-1]["end"] - start
    flops = sum(step_flops(result["model_shape"], s) for s in timed)
    return {
        "tokens_per_s": sum(s["tokens"] for s in timed) / elapsed,
        "supervised_tokens_per_s": sum(s["supervised"] for s in timed) / elapsed,
        "s_per_step": elapsed / len(timed),
        # robust to a few slow steps (a JIT compile for a new shape, a collection): same batches
        # on both sides, so the medians compare the same work
        "median_s_per_step": median(s["end"] - s["begin"] for s in timed),
        "peak_rss_mib": result["peak_rss_mib"],
        "peak_gpu_mib": result["peak_gpu_mib"],
        "final_loss": mean(s["loss"] for s in steps[-LOSS_STEPS:]),
        "model_gflops_per_s": flops / elapsed / 1e9,
        "fraction_of_peak": flops / elapsed / 1e9 / peak_gflops,
    }


def compare(sides: dict[str, dict]) -> dict:
    """Twinkle over the Trainer, and whether both really did the same work."""
    ours, theirs = sides["twinkle"], sides["hf_trainer"]
    counts = [[(s["rows"], s["tokens"], s["supervised"]) for s in r["raw"]["steps"]] for r in (ours, theirs)]
    return {
        "tokens_per_s": ours["tokens_per_s"] / theirs["tokens_per_s"],
        "median_step": theirs["median_s_per_step"] / ours["median_s_per_step"],
        "peak_rss": ours["peak_rss_mib"] / theirs["peak_rss_mib"],
        "final_loss_diff": ours["final_loss"] - theirs["final_loss"],
        "same_samples": ours["raw"]["samples_digest"] == theirs["raw"]["samples_digest"]
        and counts[0] == counts[1],
    }


def environment(peak: dict) -> dict:
    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    def field(name: str) -> str | None:
        pairs = (line.split(":", 1) for line in _cpuinfo() if ":" in line)
        return next((value.strip() for key, value in pairs if key.strip() == name), None)

    cpu = field("model name")
    # "AMD EPYC" alone names several generations, which rank oneDNN and MKL differently
    flags = set((field("flags") or "").split())
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "cpu": cpu or platform.processor(),
            "cpu_count": os.cpu_count(),
            "cpu_family_model": f"{field('cpu family')}/{field('model')}" if field("cpu family") else None,
            "vector_isa": sorted(f for f in flags if f in ("avx2", "avx512f", "avx512_bf16", "amx_tile")),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        },
        "versions": {
            "python": platform.python_version(),
            **{
                n: installed(n)
                for n in ("torch", "transformers", "peft", "accelerate", "twinkle", "liger-kernel")
            },
        },
        "matmul_peak": peak,
    }


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def table(report: dict) -> str:
    runs = [s for w in report["workloads"].values() for r in w["rounds"] for s in r.values()]
    gpu = any(s["peak_gpu_mib"] is not None for s in runs)
    head = ["workload", "round", "side", "tokens/s", "supervised tokens/s", "s/step", "median s/step"]
    head += ["peak RSS MiB"]
    head += ["peak GPU MiB"] * gpu + ["final loss", "model GFLOP/s", "% of peak"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, w in report["workloads"].items():
        for number, sides in enumerate(w["rounds"], 1):
            for side, s in sides.items():
                cells = [
                    name,
                    str(number),
                    side,
                    f"{s['tokens_per_s']:.1f}",
                    f"{s['supervised_tokens_per_s']:.1f}",
                ]
                cells += [
                    f"{s['s_per_step']:.2f}",
                    f"{s['median_s_per_step']:.2f}",
                    f"{s['peak_rss_mib']:.0f}",
                ]
                cells += [f"{s['peak_gpu_mib']:.0f}" if s["peak_gpu_mib"] is not None else "-"] * gpu
                cells += [
                    f"{s['final_loss']:.4f}",
                    f"{s['model_gflops_per_s']:.1f}",
                    f"{100 * s['fraction_of_peak']:.1f}",
                ]
                lines.append("| " + " | ".join(cells) + " |")
    peak = report["matmul_peak"]
    lines.append(
        f"\nmatmul peak: {peak['gflops']:.1f} GFLOP/s ({peak['dtype']}, {peak['device']}, "
        f"{peak['size']}x{peak['size']}, {peak['threads']} threads"
        + "".join(f"; {name} {rate:.1f}" for name, rate in peak.get("by_library", {}).items())
        + ")"
    )
    for name, w in report["workloads"].items():
        r = w.get("twinkle_over_hf_trainer")
        if r:
            same = "same samples" if r["same_samples"] else "WARNING: the sides saw different samples"
            each = ", ".join(f"{x['tokens_per_s']:.2f}x" for x in r["rounds"])
            lines.append(
                f"{name}: twinkle / hf_trainer tokens/s {r['tokens_per_s']:.2f}x (median of rounds: {each}), "
                f"by median step {r['median_step']:.2f}x, peak RSS {r['peak_rss']:.2f}x, "
                f"final loss diff {r['final_loss_diff']:+.4f} ({same})"
            )
    return "\n".join(lines)


def ratios(rounds: list[dict]) -> dict:
    """Each round's back-to-back ratios and their medians (the machine drifts between rounds)."""
    each = [compare(sides) for sides in rounds]
    return {
        "tokens_per_s": median(r["tokens_per_s"] for r in each),
        "median_step": median(r["median_step"] for r in each),
        "peak_rss": median(r["peak_rss"] for r in each),
        "final_loss_diff": max((r["final_loss_diff"] for r in each), key=abs),
        "same_samples": all(r["same_samples"] for r in each),
        "rounds": each,
    }


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    peak = matmul_peak_gflops(args.threads, dtype=resolve_dtype(args.dtype))
    print(f"matmul peak: {peak['gflops']:.1f} GFLOP/s ({peak['dtype']}, {peak['device']})", flush=True)
    report = {**environment(peak), "args": {k: str(v) for k, v in vars(args).items()}, "workloads": {}}
    with tempfile.TemporaryDirectory(prefix="twinkle-bench-") as tmp:
        folder = Path(tmp)
        for name in names:
            spec = prepare(name, args, folder)
            rounds = []
            for number in range(args.rounds):
                sides = {}
                for side in args.sides if number % 2 == 0 else args.sides[::-1]:
                    raw = run_side(side, spec, folder, args.threads)
                    sides[side] = {**summarize(raw, spec.warmup, peak["gflops"]), "raw": raw}
                rounds.append({side: sides[side] for side in args.sides})
            entry = {"spec": vars(spec), "rounds": rounds}
            if len(args.sides) == 2:
                entry["twinkle_over_hf_trainer"] = ratios(rounds)
            report["workloads"][name] = entry
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print("\n" + table(report))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
