"""What this machine allows at best for the CPU targets of the multi-adapter, DPO and sampler
benchmarks: the measured matmul peak and memory bandwidth turned into a floor on each
workload's time, the work counted from the model and the benchmarks' own batches.

    python bench/ceilings.py --out bench/results/ceilings-MACHINE-DATE.md

- Decoding one row (``bench/sampler.py``, batch 1): each new token reads every decoder weight
  and the head once, so tokens/s is at most the bandwidth of a matrix-vector product (the op
  decoding runs, timed on a 512 MiB fp32 matrix) over the bytes of those weights. The KV cache
  and activations add a few MiB and are left out (the ceiling is generous).
- A decoding step's products alone (1, 8 and 32 rows): the model's linear layers and head in
  turn, through torch's faster library for the shape: what any decoder built on torch's
  products spends before attention, norms and sampling.
- Decoding 32 rows at once: at most the matmul peak over the FLOPs per token (every linear and
  the head, 2 per multiply-add; attention left out).
- A forward pass (the mixed-adapter batch of ``bench/multi_lora.py``, the DPO reference pass):
  at least its FLOPs over the matmul peak. A DPO step's reference pass against the policy's
  forward+backward on the same batch: their FLOP ratio (``bench/harness/flops.py``'s counts:
  frozen linears 2 forward + 2 backward, LoRA 6, head 4 on supervised positions, attention);
  run at the same efficiency, the time ratio is that.

Each ceiling is set beside the benchmark's measured number (``--measured``, from the same
machine's result files) in the report. It times things; not part of the test suite."""

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import harness  # noqa: F401  (puts bench/harness on sys.path)
import torch
from flops import matmul_peak_gflops
from shapes import model_path


def gemv_bandwidth_gbs(threads: int, rounds: int = 5) -> float:
    """Bytes/s of ``F.linear`` of one row against a 512 MiB fp32 matrix, best of ``rounds``."""
    torch.set_num_threads(threads)
    weight = torch.randn(16384, 8192)
    x = torch.randn(1, 8192)
    for _ in range(3):
        torch.nn.functional.linear(x, weight)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(8):
            torch.nn.functional.linear(x, weight)
        best = min(best, (time.perf_counter() - start) / 8)
    return weight.numel() * 4 / best / 1e9


def decode_gemm_seconds(lm: Any, rows: int, threads: int, rounds: int = 3) -> float:
    """Seconds a decoding step of ``rows`` rows spends in its products alone: every decoder
    linear and the head of ``lm`` applied to ``rows`` vectors in turn (weights streamed from
    memory, as decoding does), the faster of torch's two libraries (MKL, oneDNN with packed
    weights), best of ``rounds``."""
    from twinkle.kernel import cpu_gemm

    torch.set_num_threads(threads)
    weights = [m.weight.detach() for m in lm.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    libraries = {
        "mkl": lambda x, w: torch.nn.functional.linear(x, w),
        "onednn": lambda x, w: cpu_gemm.linear(x, w, None),
    }
    best = float("inf")
    with torch.no_grad():
        for product in libraries.values():
            for r in range(rounds + 1):
                start = time.perf_counter()
                for w in weights:
                    product(inputs[w.shape[1]], w)
                if r:  # the first round packs oneDNN's copies
                    best = min(best, time.perf_counter() - start)
    return best


def model_counts(lm: Any) -> dict[str, int]:
    """Decoder linear weights, head size, layers and attention width of ``lm`` (a causal LM)."""
    linear = sum(
        m.weight.numel()
        for n, m in lm.named_modules()
        if isinstance(m, torch.nn.Linear) and "lm_head" not in n
    )
    vocab, hidden = lm.get_output_embeddings().weight.shape
    cfg = lm.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return {
        "linear": linear,
        "lora_r8": sum(
            8 * (m.in_features + m.out_features)
            for n, m in lm.named_modules()
            if isinstance(m, torch.nn.Linear) and "lm_head" not in n
        ),
        "vocab": vocab,
        "hidden": hidden,
        "layers": cfg.num_hidden_layers,
        "attention_dim": cfg.num_attention_heads * head_dim,
    }


def packed_work(batch: dict) -> tuple[int, int, int]:
    """(positions, supervised positions, causal attention pairs) of the batch as Twinkle packs it."""
    from twinkle.model.packing import pack

    packed = pack(batch)
    segments = packed["twinkle_segments"]
    pairs = segments.prefix * (segments.prefix + 1) // 2
    for start, end in segments.spans:
        n = end - start
        pairs += n * (n + 1) // 2 + n * segments.prefix
    return packed["input_ids"].shape[1], int((packed["targets"] != -100).sum()), pairs


def forward_flops(c: dict[str, int], positions: int, head: int, pairs: int) -> float:
    return (
        2.0 * positions * c["linear"]
        + 2.0 * head * c["vocab"] * c["hidden"]
        + 4.0 * c["layers"] * c["attention_dim"] * pairs
    )


def policy_flops(c: dict[str, int], positions: int, head: int, pairs: int, lora: int) -> float:
    return (
        positions * (4.0 * c["linear"] + 6.0 * lora)
        + 4.0 * head * c["vocab"] * c["hidden"]
        + 12.0 * c["layers"] * c["attention_dim"] * pairs
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--measured",
        default="",
        help="the benchmarks' numbers on this machine, name=value pairs separated by commas: "
        "hf_b1, ours_b1, hf_b32, ours_b32 (greedy tokens/s), mixed_s, separate_s (s per batch of 8), "
        "dpo_ref_ratio",
    )
    opts = p.parse_args()
    measured = {k: float(v) for k, v in (item.split("=") for item in opts.measured.split(",") if item)}
    from twinkle.model import TransformersModel

    model_id = model_path("smollm2", Path("."), seed=0)  # None: the bundled weights
    lm = TransformersModel(model_id=model_id, dtype=torch.float32).model
    c = model_counts(lm)
    peak = matmul_peak_gflops(opts.threads)["gflops"]
    bandwidth = gemv_bandwidth_gbs(opts.threads)

    from multi_lora import batches

    gemm = {rows: decode_gemm_seconds(lm, rows, opts.threads) for rows in (1, 8, 32)}
    weight_bytes = 4 * (c["linear"] + c["vocab"] * c["hidden"])
    b1 = bandwidth * 1e9 / weight_bytes
    b32 = peak * 1e9 / (2.0 * (c["linear"] + c["vocab"] * c["hidden"]))
    rows = batches(model_id, 8, 1)[0]
    mixed = forward_flops(c, *packed_work(rows))
    separate = sum(
        forward_flops(c, *packed_work({k: v[2 * i : 2 * i + 2] for k, v in rows.items()})) for i in range(4)
    )
    dpo = _dpo_batch(model_id)
    ref_over_policy = forward_flops(c, *packed_work(dpo)) / policy_flops(c, *packed_work(dpo), c["lora_r8"])

    def m(name: str) -> str:
        return f"{measured[name]:g}" if name in measured else "-"

    lines = [
        f"# Ceilings of this machine for the CPU targets ({datetime.date.today()})",
        "",
        f"Machine: {_cpu()}, {os.cpu_count()} CPUs, {opts.threads} threads; torch {torch.__version__}.",
        "",
        f"`python {' '.join(sys.argv)}`",
        "",
        f"- fp32 matmul peak: **{peak:.1f} GFLOP/s**; matrix-vector bandwidth: **{bandwidth:.1f} GB/s**",
        f"- SmolLM2-135M: {c['linear'] / 1e6:.1f} M decoder linear weights, head {c['vocab']} x {c['hidden']} "
        f"({weight_bytes / 2**20:.0f} MiB read per decoded token at fp32)",
        "",
        "| workload | ceiling | measured | target |",
        "| --- | --- | --- | --- |",
        *[
            f"| decode step of {rows} row(s), its products alone (torch's libraries) | "
            f"{rows / gemm[rows]:.1f} tokens/s ({gemm[rows] * 1e3:.1f} ms) | | |"
            for rows in gemm
        ],
        f"| greedy decode, 1 row (tokens/s) | {b1:.1f} | HF {m('hf_b1')}, Twinkle {m('ours_b1')} | 1.5x HF |",
        f"| greedy decode, 32 rows (tokens/s) | {b32:.0f} | HF {m('hf_b32')}, Twinkle {m('ours_b32')} | 1.5x HF |",
        f"| mixed-adapter forward, 8 rows (s) | >= {mixed / peak / 1e9:.3f} | {m('mixed_s')} | "
        f"1.5x faster than 4 calls of 2 rows ({m('separate_s')} s; their own floor {separate / peak / 1e9:.3f} s) |",
        f"| DPO reference / policy fwd+bwd | FLOP ratio {ref_over_policy:.3f} | {m('dpo_ref_ratio')} | <= 0.35 |",
        "",
    ]
    if "hf_b1" in measured:
        lines.append(
            f"1.5x HF at 1 row needs {1.5 * measured['hf_b1']:.1f} tokens/s: {1.5 * measured['hf_b1'] / b1:.2f}x the bandwidth ceiling."
        )
    if "hf_b32" in measured:
        lines.append(
            f"1.5x HF at 32 rows needs {1.5 * measured['hf_b32']:.0f} tokens/s: {1.5 * measured['hf_b32'] / b32:.2f}x the compute ceiling."
        )
    if "separate_s" in measured:
        best = measured["separate_s"] / (mixed / peak / 1e9)
        lines.append(
            f"A mixed batch at the matmul peak would be {best:.2f}x faster than the separate calls as measured."
        )
    text = "\n".join(lines) + "\n"
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(text)
    print(text)


def _dpo_batch(model_id: str | None) -> dict:
    """The first DPO bench batch: 4 bundled self-cognition preference pairs (8 rows, padded)."""
    import datasets

    from twinkle.dataloader import DataLoader
    from twinkle.dataset import Dataset, DatasetMeta
    from twinkle.preprocessor import SelfCognitionDPOProcessor
    from twinkle.processor import collate

    datasets.disable_progress_bars()
    dataset = Dataset(DatasetMeta("self-cognition-dpo", data_slice=range(4)))
    dataset.set_template("Template", model_id=model_id, max_length=1024)
    dataset.map(SelfCognitionDPOProcessor("twinkle大模型", "ModelScope社区"))
    dataset.encode()
    return collate(next(iter(DataLoader(dataset=dataset, batch_size=4))), dataset.pad_token_id)


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
