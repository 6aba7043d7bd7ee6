"""Expert parallelism and Ulysses sequence parallelism on CPU ranks: peak memory per rank and step
time, each against the run it replaces.

    python bench/moe_parallel.py --out bench/results/moe-parallel-MACHINE-DATE.md
    python bench/moe_parallel.py --quick --out /tmp/moe-parallel.md   # checks the script in a minute

Two parts (``--parts``, default both); each side is its own job (torchrun with 2 gloo ranks, or
one process), so its memory is its own:

- ``ep``: a random Qwen3-MoE built from a config (8 experts, top-2, hidden 256, 4 layers,
  ``moe_intermediate_size`` 1024: the experts hold about two thirds of the weights; the bundled
  SmolLM2 tokenizer and vocabulary) trained with LoRA (r 8 on attention and, through
  ``target_parameters``, on the experts; AdamW) on 2 ranks: ``ep_size=2`` (each rank holds 4
  experts of every layer, tokens go to them by all-to-all) against FSDP-only (``fsdp_size=2``,
  FSDP2 shards the experts with the rest and all-gathers them layer by layer). Each rank reads
  its own 4 rows of 256 random tokens a step. Targets: peak memory per rank <= 0.6x, step time
  <= 1.0x.
- ``sp``: a random Llama (4 layers, hidden 256, 4 query and 2 key/value heads, MLP 1024) trained
  with LoRA on one packed row of 8192 tokens: ``ulysses_size=2`` on 2 ranks (each runs half of
  the positions) against one process. Activation checkpointing is off on both sides, so the
  activations are all kept. Target: peak activation memory per rank <= 0.6x; tokens/s reported.

Memory, per rank, from ``/proc/self/status``: the peak resident set over the whole run
(``VmHWM``: loading included), the resident set once the model, adapter and optimizer are
placed, and the peak over the training steps (``VmHWM`` reset through ``/proc/self/clear_refs``
after placing). The activation part is the steps' peak minus the placed resident set (it also
holds the optimizer state made at the first step and the gradients). Each figure is the maximum
over the ranks. Time: each step's wall time (``forward_backward`` + ``clip_grad_and_step``), the
slowest rank's, median over the timed steps after ``--warmup`` untimed ones.

A 2-rank job runs one thread per rank and a 1-process job two threads, so each side uses the
machine's 2 cores. Writes a markdown report to ``--out`` and prints it."""

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
TARGETS = {"ep": {"memory": 0.6, "time": 1.0}, "sp": {"activation": 0.6}}
# full and --quick sizes of each part's model and data
EP_SHAPE = {
    "full": dict(num_hidden_layers=4, moe_intermediate_size=1024, rows=4, seq=256),
    "quick": dict(num_hidden_layers=2, moe_intermediate_size=128, rows=2, seq=64),
    # --shape experts: the experts about 90% of the weights, as in released MoE checkpoints
    "experts": dict(num_hidden_layers=2, moe_intermediate_size=8192, rows=4, seq=256),
}
SP_SHAPE = {
    "full": dict(num_hidden_layers=4, intermediate_size=1024, seq=8192),
    "quick": dict(num_hidden_layers=2, intermediate_size=256, seq=1024),
}
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


# --- the models, built once from configs with the bundled tokenizer -------------------------------


def tokenizer_ids() -> tuple[str, dict]:
    from transformers import AutoTokenizer

    from twinkle.hub import resolve_model

    folder = str(resolve_model(None))
    tok = AutoTokenizer.from_pretrained(folder)
    ids = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    return folder, ids


def save_with_tokenizer(model, tokenizer_dir: str, out: Path) -> str:
    from transformers import AutoTokenizer

    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return str(out)


def build_moe(folder: Path, size: str) -> str:
    import torch
    import transformers

    out = folder / f"qwen3-moe-{size}"
    if (out / "config.json").exists():
        return str(out)
    tokenizer_dir, ids = tokenizer_ids()
    shape = {k: v for k, v in EP_SHAPE[size].items() if k not in ("rows", "seq")}
    config = transformers.Qwen3MoeConfig(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        intermediate_size=shape["moe_intermediate_size"],
        norm_topk_prob=True,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        **shape,
        **ids,
    )
    torch.manual_seed(0)
    return save_with_tokenizer(transformers.Qwen3MoeForCausalLM(config), tokenizer_dir, out)


def build_dense(folder: Path, size: str) -> str:
    import torch
    import transformers

    out = folder / f"llama-{size}"
    if (out / "config.json").exists():
        return str(out)
    tokenizer_dir, ids = tokenizer_ids()
    shape = {k: v for k, v in SP_SHAPE[size].items() if k != "seq"}
    config = transformers.LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16384,
        tie_word_embeddings=True,
        **shape,
        **ids,
    )
    torch.manual_seed(0)
    return save_with_tokenizer(transformers.LlamaForCausalLM(config), tokenizer_dir, out)


# --- one side: a worker process (one of the torchrun ranks, or the single process) ----------------


def status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def random_rows(vocab: int, rows: int, seq: int, seed: int) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        ids = torch.randint(0, vocab, (seq,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": list(ids)})
    return out


def worker(opts) -> None:
    import torch
    from peft import LoraConfig

    import twinkle
    from twinkle import DeviceMesh
    from twinkle.dataloader import collate
    from twinkle.model import TransformersModel

    mesh = DeviceMesh.from_sizes(
        fsdp_size=opts.fsdp_size, ep_size=opts.ep_size, ulysses_size=opts.ulysses_size
    )
    runtime = twinkle.initialize(mode="local", global_device_mesh=mesh, timeout_s=1800, seed=42)
    torch.set_num_threads(opts.threads)
    fsdp_config = {"expert_parallel": {"enabled": True}} if (opts.ep_size or 1) > 1 else None
    model = TransformersModel(
        model_id=opts.model_id,
        dtype=torch.float32,
        activation_checkpointing="off",
        fsdp_config=fsdp_config,
    )
    layers = {type(m).__name__ for m in model.model.modules() if type(m).__name__.endswith("DecoderLayer")}
    model.model._no_split_modules = sorted(layers)
    torch.manual_seed(0)
    if opts.worker == "ep":
        lora = LoraConfig(
            r=8,
            lora_alpha=16,
            lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            target_parameters=EXPERTS,
        )
    else:
        lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear")
    model.add_adapter_to_model("default", lora)
    model.set_optimizer("AdamW", lr=1e-4, adapter_name="default")
    vocab = model.model.config.vocab_size
    if opts.worker == "ep":  # each data rank its own rows; the same rows on both sides
        batches = [
            collate(random_rows(vocab, opts.rows, opts.seq, 1000 * step + mesh.data_rank), 0)
            for step in range(opts.warmup + opts.steps)
        ]
    else:  # one packed row; the ranks of a Ulysses group read the same row
        batches = [
            collate(random_rows(vocab, 1, opts.seq, step), 0) for step in range(opts.warmup + opts.steps)
        ]
    placed = status_mib("VmRSS")
    load_peak = status_mib("VmHWM")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the current resident set
    times = []
    for batch in batches:
        start = time.perf_counter()
        model.forward_backward(inputs=batch, adapter_name="default")
        model.clip_grad_and_step(adapter_name="default")
        times.append(time.perf_counter() - start)
    metric = model.calculate_metric(is_training=True, adapter_name="default")
    result = {
        "rank": runtime.rank,
        "world_size": runtime.world_size,
        "placed_mib": placed,
        "load_peak_mib": load_peak,
        "steps_peak_mib": status_mib("VmHWM"),
        "run_peak_mib": max(load_peak, status_mib("VmHWM")),
        "step_s": times[opts.warmup :],
        "loss": float(metric["loss"]),
    }
    Path(opts.result_dir, f"rank-{runtime.rank}.json").write_text(json.dumps(result))


# --- the driver -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_side(opts, part: str, model_id: str, nproc: int, sizes: dict, shape: dict) -> dict:
    """One side's job; its ranks' results merged: memory the maximum over ranks, each step the
    slowest rank's time."""
    result_dir = Path(tempfile.mkdtemp(prefix=f"moe-parallel-{part}-"))
    args = [str(HERE), "--worker", part, "--model-id", model_id, "--result-dir", str(result_dir)]
    args += ["--steps", str(opts.steps), "--warmup", str(opts.warmup), "--threads", str(2 // nproc or 1)]
    args += ["--seq", str(shape["seq"]), "--rows", str(shape.get("rows", 1))]
    for name, value in sizes.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    if nproc > 1:
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1",
            "--nproc_per_node",
            str(nproc),
        ]
        argv += ["--master_addr", "127.0.0.1", "--master_port", str(free_port()), *args]
    else:
        argv = [sys.executable, *args]
    env = {**os.environ, "OMP_NUM_THREADS": str(2 // nproc or 1), "PYTHONUNBUFFERED": "1"}
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{part} {sizes} failed:\n{(done.stdout + done.stderr)[-6000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(result_dir.glob("rank-*.json"))]
    steps = [max(r["step_s"][i] for r in ranks) for i in range(opts.steps)]
    return {
        "ranks": len(ranks),
        "run_peak": max(r["run_peak_mib"] for r in ranks),
        "load_peak": max(r["load_peak_mib"] for r in ranks),
        "placed": max(r["placed_mib"] for r in ranks),
        "steps_peak": max(r["steps_peak_mib"] for r in ranks),
        "activation": max(r["steps_peak_mib"] - r["placed_mib"] for r in ranks),
        "median_s": statistics.median(steps),
        "steps_s": steps,
        "loss": ranks[0]["loss"],
        "job_s": time.perf_counter() - start,
    }


def memory_table(sides: dict[str, dict], tokens: int | None = None) -> list[str]:
    head = "| side | ranks | peak RSS, whole run | peak RSS, loading | RSS placed | peak RSS, steps | "
    head += "steps' peak - placed | median s/step | steps (s) |"
    if tokens:
        head += " tokens/s |"
    lines = [
        "Memory in MiB per rank (the maximum over the ranks).",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for name, s in sides.items():
        row = (
            f"| {name} | {s['ranks']} | {s['run_peak']:,.0f} | {s['load_peak']:,.0f} | {s['placed']:,.0f} | "
            f"{s['steps_peak']:,.0f} | {s['activation']:,.0f} | {s['median_s']:.3f} | "
            f"{', '.join(f'{t:.2f}' for t in s['steps_s'])} |"
        )
        if tokens:
            row += f" {tokens / s['median_s']:,.0f} |"
        lines.append(row)
    return lines


def verdict(value: float, target: float) -> str:
    return f"**{value:.2f}x** (target <= {target}x: {'met' if value <= target else 'not met'})"


def part_ep(opts, folder: Path) -> list[str]:
    model_id = build_moe(folder, opts.size)
    shape = EP_SHAPE[opts.size]
    sides = {
        "FSDP-only (fsdp_size=2)": run_side(opts, "ep", model_id, 2, {"fsdp_size": 2}, shape),
        "EP (ep_size=2, fsdp_size=2)": run_side(
            opts, "ep", model_id, 2, {"fsdp_size": 2, "ep_size": 2}, shape
        ),
    }
    base, ep = sides.values()
    target = TARGETS["ep"]
    layers, inter = shape["num_hidden_layers"], shape["moe_intermediate_size"]
    return [
        "## Expert parallelism: EP 2 against FSDP-only on 2 ranks",
        "",
        f"Qwen3-MoE, random weights: {layers} layers, hidden 256, 8 experts top-2, moe_intermediate_size "
        f"{inter}, 4 query / 2 key-value heads of 64, tied embeddings over the 49,152-token vocabulary; "
        f"LoRA r 8 on attention and the experts (`target_parameters`), AdamW; each rank {shape['rows']} rows "
        f"of {shape['seq']} tokens a step; {opts.warmup} untimed step(s), then {opts.steps}.",
        "",
        *memory_table(sides),
        "",
        f"- peak RSS per rank over the steps, EP / FSDP-only: "
        f"{verdict(ep['steps_peak'] / base['steps_peak'], target['memory'])}",
        f"- peak RSS per rank over the whole run (loading included), EP / FSDP-only: "
        f"{ep['run_peak'] / base['run_peak']:.2f}x",
        f"- steps' peak above the placed model, EP / FSDP-only: {ep['activation'] / base['activation']:.2f}x",
        f"- median step time, EP / FSDP-only: {verdict(ep['median_s'] / base['median_s'], target['time'])} "
        "(indicative only, see above)",
        f"- final-step loss: FSDP-only {base['loss']:.4f}, EP {ep['loss']:.4f}",
    ]


def part_sp(opts, folder: Path) -> list[str]:
    size = "quick" if opts.size == "quick" else "full"  # --shape is the EP part's
    model_id = build_dense(folder, size)
    shape = SP_SHAPE[size]
    sides = {
        "1 process": run_side(opts, "sp", model_id, 1, {}, shape),
        "Ulysses (ulysses_size=2, fsdp_size=2)": run_side(
            opts, "sp", model_id, 2, {"fsdp_size": 2, "ulysses_size": 2}, shape
        ),
    }
    one, sp = sides.values()
    layers, inter = shape["num_hidden_layers"], shape["intermediate_size"]
    return [
        "## Ulysses sequence parallelism: 2 ranks against 1 process",
        "",
        f"Llama, random weights: {layers} layers, hidden 256, 4 query / 2 key-value heads of 64, MLP {inter}, "
        f"tied embeddings over the 49,152-token vocabulary; LoRA r 8 on every linear layer, AdamW; one "
        f"packed row of {shape['seq']:,} tokens a step, every position supervised; activation checkpointing "
        f"off; {opts.warmup} untimed step(s), then {opts.steps}.",
        "",
        *memory_table(sides, tokens=shape["seq"]),
        "",
        f"- activation memory per rank (steps' peak - placed), Ulysses / 1 process: "
        f"{verdict(sp['activation'] / one['activation'], TARGETS['sp']['activation'])}",
        f"- peak RSS per rank over the steps, Ulysses / 1 process: {sp['steps_peak'] / one['steps_peak']:.2f}x; "
        f"over the whole run: {sp['run_peak'] / one['run_peak']:.2f}x",
        f"- tokens/s, Ulysses / 1 process: {one['median_s'] / sp['median_s']:.2f}x (indicative only, see above)",
        f"- final-step loss: 1 process {one['loss']:.4f}, Ulysses {sp['loss']:.4f}",
    ]


def machine() -> str:
    import torch

    fields = {}
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    for line in out.splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    cpu = f"{fields.get('Model name', '?')} (family {fields.get('CPU family', '?')}, model {fields.get('Model', '?')})"
    return f"{cpu}, {os.cpu_count()} cores; torch {torch.__version__}; {datetime.date.today()}"


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


PARTS = {"ep": part_ep, "sp": part_sp}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per side (ep 5, sp 2)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--quick", action="store_true", help="tiny models and sequences: checks the script")
    parser.add_argument(
        "--shape", choices=("full", "experts"), default="full",
        help="the EP part's model: full (experts two thirds of the weights) or experts (about 90%%)",
    )  # fmt: skip
    parser.add_argument("--out", default="output/moe-parallel.md", help="the markdown report")
    # a worker's own arguments (the driver passes them)
    parser.add_argument("--worker", choices=PARTS, help=argparse.SUPPRESS)
    parser.add_argument("--model-id", help=argparse.SUPPRESS)
    parser.add_argument("--result-dir", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, default=1, help=argparse.SUPPRESS)
    for size in ("--fsdp-size", "--ep-size", "--ulysses-size"):
        parser.add_argument(size, type=int, default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        worker(opts)
        import twinkle

        twinkle.runtime.shutdown()
        return
    parts = opts.parts.split(",")
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"--parts: unknown {', '.join(sorted(unknown))}; choose from {', '.join(PARTS)}")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    opts.size = "quick" if opts.quick else opts.shape
    folder = Path(tempfile.gettempdir()) / "twinkle-bench-models"
    folder.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python", "bench/moe_parallel.py", *sys.argv[1:]])
    load_start = loadavg()
    sections = []
    for name in parts:
        steps = opts.steps
        if steps is None:
            opts.steps = 5 if name == "ep" else 2
        sections += ["", *PARTS[name](opts, folder)]
        opts.steps = steps
    load_end = loadavg()
    lines = [
        "# Expert and sequence parallelism on CPU ranks: memory and step time",
        "",
        f"Machine: {machine()}. fp32, gloo; a 2-rank side runs one thread per rank, a 1-process side two.",
        "",
        "```bash",
        command,
        "```",
        "",
        f"Load average (1, 5, 15 min) at the start: {load_start}; at the end: {load_end}. "
        + "Other jobs shared the cores while the steps ran, so the step times and tokens/s are "
        "indicative only; the memory figures and their ratios are what this run measures.",
        *sections,
    ]
    report = "\n".join(lines) + "\n"
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
