"""Padded against packed training steps on a small random Qwen3.5 text model (linear-attention
layers among full-attention ones) with rows of very unequal lengths.

    python bench/micro/hybrid_packing.py
    python bench/micro/hybrid_packing.py --lengths 64 96 128 2000 --repeats 7 --threads 4

A step is ``twinkle.model.forward.compute_loss`` (packed or padded) and its backward, with LoRA
on every linear layer (``all-linear``, rank 8); the optimizer's update is left out, as it is the
same for both layouts. The two layouts run alternately after one warm-up each; the table gives
each one's median seconds, the tokens it computes (packed: the samples end to end, each
linear-attention layer per sample; padded: every row as long as the longest) and the loss of
both (equal up to summation order)."""

import argparse
import statistics
import time

import _paths  # noqa: F401  (puts bench/ and bench/harness on sys.path)
import torch
import transformers

from twinkle.loss import CrossEntropyLoss
from twinkle.model.forward import compute_loss

VOCAB = 1024


def build_model(hidden: int, layers: int, threads: int) -> torch.nn.Module:
    """A random Qwen3.5 text model, three linear-attention layers to each full-attention one (as
    Qwen3.5 lays them out), with LoRA adapters on its linear layers."""
    from peft import LoraConfig, get_peft_model

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    heads = max(2, hidden // 64)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)],
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=64,
        linear_num_key_heads=heads,
        linear_num_value_heads=2 * heads,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        max_position_embeddings=8192,
        attn_implementation="sdpa",
    )
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    return get_peft_model(model, lora)


def make_batch(lengths: list[int], prompt: int) -> dict[str, torch.Tensor]:
    """Right-padded rows of the given lengths, labelled after their first ``prompt`` tokens."""
    g = torch.Generator().manual_seed(0)
    width = max(lengths)
    batch = {k: torch.zeros(len(lengths), width, dtype=torch.long) for k in ("input_ids", "attention_mask")}
    batch["position_ids"] = torch.zeros(len(lengths), width, dtype=torch.long)
    batch["labels"] = torch.full((len(lengths), width), -100)
    for i, n in enumerate(lengths):
        batch["input_ids"][i, :n] = torch.randint(1, VOCAB, (n,), generator=g)
        batch["attention_mask"][i, :n] = 1
        batch["position_ids"][i, :n] = torch.arange(n)
        batch["labels"][i, prompt:n] = batch["input_ids"][i, prompt:n]
    return batch


def step(model: torch.nn.Module, batch: dict[str, torch.Tensor], padding_free: bool) -> tuple[float, float]:
    """Seconds of one forward and backward, and its summed loss."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    out = compute_loss(model, batch, CrossEntropyLoss(), padding_free=padding_free)
    out.loss_sum.backward()
    return time.perf_counter() - start, float(out.loss_sum.detach())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[48, 64, 80, 96, 128, 1024])
    parser.add_argument("--prompt", type=int, default=16, help="unlabelled tokens at each row's start")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model = build_model(args.hidden, args.layers, args.threads)
    batch = make_batch(args.lengths, args.prompt)
    times: dict[bool, list[float]] = {False: [], True: []}
    losses = {}
    for padding_free in (False, True):  # warm-up
        step(model, batch, padding_free)
    for _ in range(args.repeats):
        for padding_free in (False, True):
            seconds, losses[padding_free] = step(model, batch, padding_free)
            times[padding_free].append(seconds)
    tokens = {False: len(args.lengths) * max(args.lengths), True: sum(n - 1 for n in args.lengths)}
    print(
        f"Qwen3.5 text, hidden {args.hidden}, {args.layers} layers, rows {args.lengths}, "
        f"{args.threads} threads, {torch.__version__}, transformers {transformers.__version__}"
    )
    print("| layout | tokens computed | median s | loss sum |")
    print("|---|---|---|---|")
    for padding_free, name in ((False, "padded"), (True, "packed")):
        median = statistics.median(times[padding_free])
        print(f"| {name} | {tokens[padding_free]} | {median:.3f} | {losses[padding_free]:.4f} |")
    ratio = statistics.median(times[False]) / statistics.median(times[True])
    print(f"padded / packed: {ratio:.2f}x")


if __name__ == "__main__":
    main()
