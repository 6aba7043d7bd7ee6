"""``TorchSampler`` against Hugging Face ``generate()`` (with its KV cache): generated tokens per
second on the same model, prompts, batch, ``max_tokens`` and sampling settings.

    python bench/sampler.py --out bench/results/sampler-MACHINE-DATE.md
    python bench/sampler.py --smoke --out /tmp/sampler.md     # checks the script in seconds

Each case (``--cases``: greedy and sampled at temperature 1, top-p 0.95, no top-k, at batch
sizes 1, 8 and 32, and GRPO's shape, 4 prompts with 8 samples each, ``num_samples`` here and
``num_return_sequences`` there; ``--max-tokens``, default 128) runs both sides
back to back ``--rounds`` times, alternating which goes first (a shared machine drifts by tens
of percent over minutes; pairing cancels most of it), after one untimed warm-up call each. The
ratio reported is the median of the rounds' ratios. A side's tokens are those it generated up
to and including each row's end-of-sequence token: ``generate`` pads a finished row until the
batch is done, those pads are not counted. Both sides load the model separately (fp32 on CPU),
so neither benefits from the other's state; in greedy mode the report also says on how many
rows both sides generated the same tokens (not necessarily all: TorchSampler's products run
where training's do, oneDNN on the CPU, whose summation order differs from ``generate``'s by
about 1e-6, enough to flip a near-tie late in a long reply).

``--model``: ``smollm2`` (the bundled SmolLM2-135M-Instruct, default) or a random shape of
``bench/harness/shapes.py`` (``tiny`` for ``--smoke``). Writes a markdown report (and the same
numbers as JSON beside it) to ``--out`` and prints it."""

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness  # noqa: F401  (puts bench/harness on sys.path)
import torch
from shapes import CHOICES, model_path

TOPICS = ["apples", "books", "coins", "marbles", "pencils", "stamps", "shells", "cards"]
SAMPLED = {"temperature": 1.0, "top_p": 0.95}
# batch sizes 1, 8 and 32, greedy and sampled; and GRPO's shape: 4 prompts, 8 samples each
CASES = "greedy:1,greedy:8,greedy:32,sampled:1,sampled:8,sampled:32,sampled:4x8"


def prompts(count: int) -> list[list[dict[str, str]]]:
    """``count`` short word problems of different lengths, as chat messages."""
    out = []
    for i in range(count):
        a, b, thing = 3 + 7 * i % 40, 2 + 5 * i % 17, TOPICS[i % len(TOPICS)]
        extra = " Explain each step." * (i % 3)
        text = f"Tom has {a} {thing} and buys {b} more. How many {thing} does he have now?{extra}"
        out.append([{"role": "user", "content": text}])
    return out


def encode(tokenizer, messages: list[list[dict[str, str]]]) -> list[list[int]]:
    from twinkle.template import Template

    template = Template(tokenizer)
    texts = [template.render(m, add_generation_prompt=True) for m in messages]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def counted(tokens: list[int], eos: set[int]) -> int:
    """Tokens up to and including the first end-of-sequence token."""
    for i, t in enumerate(tokens):
        if t in eos:
            return i + 1
    return len(tokens)


def run_hf(
    model, tokenizer, ids: list[list[int]], mode: str, n: int, max_tokens: int, eos: set[int], seed: int
):
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    width = max(map(len, ids))
    batch = torch.full((len(ids), width), pad, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for i, p in enumerate(ids):
        batch[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    settings = {"do_sample": False} if mode == "greedy" else {"do_sample": True, "top_k": 0, **SAMPLED}
    torch.manual_seed(seed)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=batch,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            min_new_tokens=0,
            pad_token_id=pad,
            eos_token_id=sorted(eos),
            num_return_sequences=n,
            **settings,
        )
    seconds = time.perf_counter() - start
    rows = [out[i, width:].tolist() for i in range(out.shape[0])]
    rows = [r[: counted(r, eos)] for r in rows]
    return seconds, rows


def run_twinkle(sampler, ids: list[list[int]], mode: str, n: int, max_tokens: int, seed: int):
    from twinkle.sampler import SamplingParams

    settings = {"temperature": 0.0} if mode == "greedy" else SAMPLED
    params = SamplingParams(max_tokens=max_tokens, seed=seed, num_samples=n, **settings)
    start = time.perf_counter()
    responses = sampler.sample([{"input_ids": p} for p in ids], params)
    seconds = time.perf_counter() - start
    return seconds, [s.tokens for r in responses for s in r.sequences]


def measure(args, path: str | None) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from twinkle.hub import resolve_model
    from twinkle.sampler import TorchSampler
    from twinkle.sampler.stops import eos_token_ids

    folder = str(resolve_model(path))
    sampler = TorchSampler(folder, dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    eos = eos_token_ids(hf, sampler.tokenizer)
    sides = {
        "hf_generate": lambda ids, mode, n, seed: run_hf(
            hf, sampler.tokenizer, ids, mode, n, args.max_tokens, eos, seed
        ),
        "twinkle": lambda ids, mode, n, seed: run_twinkle(sampler, ids, mode, n, args.max_tokens, seed),
    }
    warm = encode(sampler.tokenizer, prompts(2))
    for side in sides.values():
        side(warm, "greedy", 1, 0)
    results = []
    for mode, size, n in args.cases:
        ids = encode(sampler.tokenizer, prompts(size))
        results.append(case(sides, ids, mode, n, args.rounds, args.seed))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    return results


def case(sides, ids: list[list[int]], mode: str, n: int, rounds: int, seed: int) -> dict:
    per_side = {name: [] for name in sides}
    ratios, same = [], None
    for r in range(rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        done = {name: sides[name](ids, mode, n, seed + r) for name in order}
        rate = {name: sum(map(len, rows)) / seconds for name, (seconds, rows) in done.items()}
        for name in sides:
            per_side[name].append({"seconds": done[name][0], "tokens": sum(map(len, done[name][1]))})
        ratios.append(rate["twinkle"] / rate["hf_generate"])
        if mode == "greedy":
            same = sum(a == b for a, b in zip(done["twinkle"][1], done["hf_generate"][1], strict=True))
    tokens_per_s = {
        name: statistics.median(x["tokens"] / x["seconds"] for x in runs) for name, runs in per_side.items()
    }
    return {
        "mode": mode,
        "batch": len(ids) * n,
        "prompts": len(ids),
        "num_samples": n,
        "prompt_tokens": [min(map(len, ids)), max(map(len, ids))],
        "tokens_per_s": tokens_per_s,
        "ratio": statistics.median(ratios),
        "same_rows": same,
        "rounds": per_side,
    }


def report(args, results: list[dict]) -> str:
    import transformers

    lines = [
        f"# TorchSampler vs Hugging Face generate ({datetime.date.today()})",
        "",
        f"Model `{args.model}`, fp32, `max_tokens` {args.max_tokens}, {args.rounds} round(s), "
        f"{args.threads} thread(s); {platform.processor() or platform.machine()}; torch {torch.__version__}, "
        f"transformers {transformers.__version__}. Sampled: temperature 1, top-p 0.95, no top-k.",
        "",
        "| mode | rows (prompts x samples) | prompt tokens | HF generate tok/s | TorchSampler tok/s | "
        "ratio (median) | same rows |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        tps = r["tokens_per_s"]
        same = "" if r["same_rows"] is None else f"{r['same_rows']}/{r['batch']}"
        lo, hi = r["prompt_tokens"]
        lines.append(
            f"| {r['mode']} | {r['batch']} ({r['prompts']}x{r['num_samples']}) | {lo}-{hi} | {tps['hf_generate']:.1f} | {tps['twinkle']:.1f} | "
            f"{r['ratio']:.2f}x | {same} |"
        )
    return "\n".join(lines) + "\n"


def parse_case(text: str) -> tuple[str, int, int]:
    """``sampled:4x8`` -> ("sampled", 4 prompts, 8 samples each)."""
    mode, _, size = text.partition(":")
    prompts_, _, n = size.partition("x")
    if mode not in ("greedy", "sampled") or not prompts_.isdigit() or not (n or "1").isdigit():
        raise SystemExit(f"--cases: {text!r} is not MODE:PROMPTS[xSAMPLES] with MODE greedy or sampled")
    return mode, int(prompts_), int(n or 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=CHOICES, default=None)
    parser.add_argument(
        "--cases", default=CASES, help="MODE:PROMPTS or MODE:PROMPTSxSAMPLES, comma-separated"
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--smoke", action="store_true", help="tiny model, small batches, 8 tokens, 1 round")
    parser.add_argument("--out", default="output/sampler-bench.md")
    args = parser.parse_args()
    if args.smoke:
        args.model = args.model or "tiny"
        args.cases, args.max_tokens, args.rounds = "greedy:1,greedy:2,sampled:2,sampled:2x2", 8, 1
    args.model = args.model or "smollm2"
    args.cases = [parse_case(c) for c in args.cases.split(",")]
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        results = measure(args, model_path(args.model, Path(tmp), args.seed))
    text = report(args, results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
