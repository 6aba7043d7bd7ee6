"""Several LoRA adapters on one base model (``MultiLoraTransformersModel``): switching cost,
memory per slot, and mixed-adapter evaluation.

    python bench/multi_lora.py --steps 8 --rounds 5 --out bench/results/multi-lora-MACHINE-DATE.md
    python bench/multi_lora.py --model tiny --steps 2 --rounds 1 --out /tmp/ml.md   # checks the script

Three parts (``--parts``, default all), each on the bundled SmolLM2-135M in fp32 unless
``--model`` says otherwise, every timed pair run A/B then B/A in alternate rounds, medians
reported (a shared machine drifts by tens of percent over minutes; pairing cancels most of it):

- ``interleave``: adapters ``a`` (r 8, Muon, as the contract) and ``b`` (r 16, AdamW), as
  ``cookbook/transformers/multi_lora.py`` trains them, ``--steps`` batches of 4 each: a, b, a,
  b, ... (interleaved) against a, a, ..., b, b, ... (the same steps run solo one after the
  other), on the same model and batches. Target: interleaved / solo <= 1.05. A plain
  ``TransformersModel`` with one r 8 adapter running the same number of steps is timed too: the
  cost of the slots themselves.
- ``memory``: the bytes a slot costs at r 32 (its LoRA weights, and for a trained adapter its
  gradients, AdamW's two moments and the optimizer's rank-r copies), counted from the tensors;
  and the peak resident memory (RSS) of a process that trains 1 and 5 adapters of r 32
  (``max_r`` 32) for ``--steps`` steps each, each count in its own process, alternating.
- ``mixed``: ``forward_only`` of a batch of 8 rows over 4 adapters (two rows each,
  ``adapter_names=``) against 4 ``forward_only`` calls of 2 rows each (``adapter_name=``).
  Target: >= 1.5x faster.

Writes a markdown report to ``--out`` and prints it."""

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness  # noqa: F401  (puts bench/harness on sys.path)
import torch
from shapes import CHOICES, model_path

from twinkle.utils.memory import peak_rss_mib

HERE = Path(__file__).resolve()
ADAPTERS = {  # name -> (rank, optimizer, its keywords), as the cookbook's two identities
    "a": (8, "Muon", {"adjust_lr_fn": "match_rms_adamw"}),
    "b": (16, "AdamW", {}),
}
MIXED = ("w", "x", "y", "z")  # the four adapters of a mixed batch


def lora(r: int, dropout: float = 0.05):
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=32, lora_dropout=dropout, target_modules="all-linear")


def batches(model_id: str | None, size: int, count: int) -> list[dict]:
    """``count`` batches of ``size`` self-cognition rows (the cookbook's data)."""
    import datasets

    from twinkle.dataloader import DataLoader
    from twinkle.dataset import Dataset, DatasetMeta
    from twinkle.preprocessor import SelfCognitionProcessor

    datasets.disable_progress_bars()
    dataset = Dataset(DatasetMeta(None, data_slice=range(size * count)))
    dataset.set_template("Template", model_id=model_id, max_length=1024)
    dataset.map(SelfCognitionProcessor("Twinkle", "ModelScope"))
    dataset.encode()
    return list(DataLoader(dataset=dataset, batch_size=size))[:count]


def multi_model(model_id: str | None, specs: dict, max_r: int, max_loras: int | None = None):
    from twinkle.kernel import kernelize
    from twinkle.model import MultiLoraTransformersModel

    model = MultiLoraTransformersModel(model_id, max_loras=max_loras or len(specs), max_r=max_r)
    model = kernelize(model)
    for name, (r, optimizer, kwargs) in specs.items():
        model.add_adapter_to_model(name, lora(r))
        model.set_optimizer(optimizer, lr=1e-3, adapter_name=name, **kwargs)
    return model


def train_step(model, batch, name: str | None = None) -> None:
    model.forward_backward(inputs=batch, adapter_name=name)
    model.clip_grad_and_step(adapter_name=name)


def timed(run) -> float:
    start = time.perf_counter()
    run()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def paired(arms: dict, rounds: int) -> dict[str, list[float]]:
    """Each arm's time per round; the arms' order turns round by round."""
    order, times = list(arms), {name: [] for name in arms}
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            times[name].append(timed(arms[name]))
    return times


def part_interleave(opts) -> list[str]:
    from twinkle.kernel import kernelize
    from twinkle.model import TransformersModel

    data = batches(opts.model_id, 4, opts.steps)
    model = multi_model(opts.model_id, ADAPTERS, max_r=16)
    plain = kernelize(TransformersModel(opts.model_id))
    plain.add_adapter_to_model("default", lora(8))
    plain.set_optimizer("Muon", lr=1e-3, adjust_lr_fn="match_rms_adamw")
    arms = {
        "interleaved": lambda: [train_step(model, b, n) for b in data for n in ADAPTERS],
        "solo": lambda: [train_step(model, b, n) for n in ADAPTERS for b in data],
        "plain": lambda: [train_step(plain, b) for b in data for _ in ADAPTERS],
    }
    for arm in arms.values():  # warm-up: the first steps build caches and optimizer state
        arm()
    times = paired(arms, opts.rounds)
    ratios = [i / s for i, s in zip(times["interleaved"], times["solo"], strict=True)]
    steps = 2 * opts.steps
    lines = [
        "## Interleaved adapters against the same steps run solo",
        "",
        f"{opts.steps} batches of 4 for each of a (r 8, Muon) and b (r 16, AdamW); {opts.rounds} rounds, "
        "arms alternating.",
        "",
        "| arm | median s/step | min-max s/step |",
        "|---|---|---|",
    ]
    for name, values in times.items():
        per = [v / steps for v in values]
        lines.append(f"| {name} | {statistics.median(per):.3f} | {min(per):.3f}-{max(per):.3f} |")
    plain_ratio = statistics.median(i / p for i, p in zip(times["interleaved"], times["plain"], strict=True))
    lines += [
        "",
        f"interleaved / solo, median of the rounds' ratios: **{statistics.median(ratios):.3f}** "
        f"(rounds: {', '.join(f'{r:.3f}' for r in ratios)}; target <= 1.05)",
        f"interleaved / plain single-adapter model: {plain_ratio:.3f}",
    ]
    return lines


def slot_bytes(model, name: str) -> dict[str, int]:
    """Bytes of one adapter's slot (all its weights, at max_r), its optimizer's rank-r copies and
    state, and the gradients that exist during a step (the slot's, then the copies')."""
    slot = model.slots.holder[name]
    weights = sum(p.numel() * p.element_size() for n, p in model.model.named_parameters() if f".{slot}." in n)
    optimizer = model.optimizer_group[name].optimizer
    copies = sum(c.numel() * c.element_size() for c in optimizer.copies)
    state = sum(
        t.numel() * t.element_size()
        for entry in optimizer.optimizer.state.values()
        for t in entry.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    return {
        "slot weights (max_r)": weights,
        "optimizer's rank-r copies": copies,
        "optimizer state": state,
        "gradients during a step (slot and copies)": weights + copies,
    }


def rss_child(opts) -> None:
    """One process: ``--adapters`` adapters of r 32 (AdamW), ``--steps`` steps each; prints its
    peak RSS in MiB and the bytes of one slot."""
    names = [f"t{i}" for i in range(opts.adapters)]
    model = multi_model(opts.model_id, {n: (32, "AdamW", {}) for n in names}, max_r=32)
    for batch in batches(opts.model_id, 4, opts.steps):
        for name in names:
            train_step(model, batch, name)
    peak = peak_rss_mib()
    print(json.dumps({"peak_rss_mib": peak, "slot": slot_bytes(model, names[0])}))


def part_memory(opts) -> list[str]:
    def child(count: int) -> dict:
        argv = [
            sys.executable,
            str(HERE),
            "--rss-child",
            "--adapters",
            str(count),
            "--steps",
            str(opts.steps),
        ]
        argv += ["--model", opts.model, "--threads", str(opts.threads)]
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(done.stderr[-3000:])
        return json.loads(done.stdout.strip().splitlines()[-1])

    peaks, slot = {1: [], 5: []}, None
    for r in range(opts.rounds):
        for count in (1, 5) if r % 2 == 0 else (5, 1):
            result = child(count)
            peaks[count].append(result["peak_rss_mib"])
            slot = result["slot"]
    total = sum(slot.values())
    lines = [
        "## Memory",
        "",
        "One slot at r 32 (fp32), trained with AdamW:",
        "",
        "| part | MiB |",
        "|---|---|",
        *(f"| {k} | {v / 2**20:.2f} |" for k, v in slot.items()),
        f"| **total per slot** | **{total / 2**20:.2f}** |",
        "",
        f"Peak RSS, {opts.steps} steps of each adapter, median of {opts.rounds} processes each:",
        "",
        "| adapters | median MiB | min-max MiB |",
        "|---|---|---|",
    ]
    for count, values in peaks.items():
        lines.append(
            f"| {count} | {statistics.median(values):,.0f} | {min(values):,.0f}-{max(values):,.0f} |"
        )
    extra = (statistics.median(peaks[5]) - statistics.median(peaks[1])) / 4
    lines += ["", f"Each extra adapter: {extra:.1f} MiB of RSS (the tensors count {total / 2**20:.1f} MiB)."]
    return lines


def part_mixed(opts) -> list[str]:
    model = multi_model(opts.model_id, {n: (8, "AdamW", {}) for n in MIXED}, max_r=8)
    data = batches(opts.model_id, 8, 1 + opts.steps)
    for batch in data[:1]:
        for name in MIXED:
            train_step(model, batch, name)  # every adapter's B moves off zero
    rows = [n for n in MIXED for _ in range(2)]

    def mixed() -> None:
        for batch in data[1:]:
            model.forward_only(batch, adapter_names=rows)

    def separate(per_row_names: bool) -> None:
        for batch in data[1:]:
            for i, name in enumerate(MIXED):
                part = {k: v[2 * i : 2 * i + 2] for k, v in batch.items()}
                if per_row_names:
                    model.forward_only(part, adapter_names=[name, name])
                else:
                    model.forward_only(part, adapter_name=name)

    arms = {
        "mixed": mixed,
        "separate": lambda: separate(False),
        "separate, adapter_names": lambda: separate(True),
    }
    for arm in arms.values():
        arm()
    times = paired(arms, opts.rounds)
    lines = [
        "## A mixed-adapter batch against one call per adapter",
        "",
        f"{opts.steps} batches of 8 rows, 2 rows for each of 4 adapters (r 8); {opts.rounds} rounds.",
        "",
        "| arm | median s/batch of 8 | speed-up of mixed (median of the rounds' ratios) |",
        "|---|---|---|",
    ]
    for name, values in times.items():
        speedup = statistics.median(v / m for v, m in zip(values, times["mixed"], strict=True))
        lines.append(f"| {name} | {statistics.median(values) / opts.steps:.3f} | {speedup:.2f}x |")
    lines += ["", "Target: mixed >= 1.5x faster than 4 `forward_only(adapter_name=...)` calls of 2 rows."]
    return lines


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"{cpu}, CPU"
    return f"{device}; torch {torch.__version__}; {datetime.date.today()}"


PARTS = {"interleave": part_interleave, "memory": part_memory, "mixed": part_mixed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--steps", type=int, default=8, help="batches per adapter (per arm for mixed)")
    parser.add_argument("--rounds", type=int, default=5, help="repetitions of each pair, alternating")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", choices=CHOICES, default="smollm2", help="see bench/harness/shapes.py")
    parser.add_argument("--out", default="output/multi-lora.md", help="the markdown report")
    parser.add_argument("--rss-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--adapters", type=int, default=1, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    import transformers

    import twinkle

    transformers.utils.logging.disable_progress_bar()
    twinkle.initialize(seed=42)
    opts.model_id = model_path(opts.model, Path(tempfile.gettempdir()) / "twinkle-bench-models", 42)
    if opts.rss_child:
        rss_child(opts)
        return
    unknown = set(opts.parts.split(",")) - set(PARTS)
    if unknown:
        raise SystemExit(f"--parts: unknown {', '.join(sorted(unknown))}; choose from {', '.join(PARTS)}")
    command = " ".join(["python", "bench/multi_lora.py", *sys.argv[1:]])
    lines = [
        "# Several adapters on one base model: switching, memory, mixed batches",
        "",
        f"Machine: {machine()}; {opts.threads} threads. Model: {opts.model}, fp32.",
        "",
        "```bash",
        command,
        "```",
    ]
    for name in opts.parts.split(","):
        lines += ["", *PARTS[name](opts)]
    report = "\n".join(lines) + "\n"
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
