"""Multi-turn rollout throughput: ``MultiTurnRollout`` on ``TorchSampler`` against the same
environments driven by Hugging Face ``generate()``, turn by turn; and the share of a GRPO step
spent waiting on environments.

    python bench/agentic_rollout.py --out bench/results/agentic-rollout-MACHINE-DATE.md
    python bench/agentic_rollout.py --smoke --out /tmp/agentic.md     # checks the script quickly

The task is the cookbook's (``cookbook/rl/multi_turn_grpo.py``): ``--trajectories`` episodes of
``ArithmeticEnv`` with fixed seeds, the same prompt, at most ``--max-turns`` replies of
``--max-tokens`` tokens, greedy (so every side plays the same conversations, up to ties), tool
calls in SmolLM2's format. Three sides play them, through the same rollout loop (so parsing, tool
execution and masking are identical and only generation differs):

- ``twinkle``: ``TorchSampler``, every live trajectory of a turn in one call (the prompts'
  common prefix, the system turn and the worked examples, prefilled once);
- ``hf-sequential``: ``model.generate`` one trajectory at a time, turn by turn (the usual
  agent loop written on transformers);
- ``hf-batched``: ``model.generate`` on every live trajectory of a turn, left-padded.

Both ``generate`` sides return the log-probs training needs (``output_logits``). Each side runs
``--rounds`` times after an untimed warm-up; the median is reported. Throughput counts turns
(replies) and generated tokens per second of rollout wall time.

The GRPO step: one ``twinkle`` rollout, then ``forward_backward`` + ``clip_grad_and_step`` on its
trajectories with ``GRPOLoss``, timed in parts, with the environments as they are and with
``--env-delay`` seconds added to every step (an environment that waits on something, e.g. a
sandbox): the share of the step spent waiting on environments."""

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

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "cookbook" / "rl"))  # noqa: E402


def cpu_name() -> str:
    """lscpu's model name with its family and model numbers (a name alone, 'AMD EPYC', does not
    tell the generations apart)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return platform.processor() or "unknown"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    name = fields.get("Model name", "unknown").strip()
    return (
        f"{name} (family {fields.get('CPU family', '?').strip()}, model {fields.get('Model', '?').strip()})"
    )


class GenerateSampler:
    """``sample(rows, params)`` over ``model.generate``: per row (``batched=False``) or all rows
    of a call left-padded in one ``generate`` (``batched=True``); greedy or sampled, with the
    sampled tokens' log-probs at temperature 1 from the raw logits."""

    def __init__(self, model, tokenizer, batched: bool):
        self.model, self.tokenizer, self.batched = model, tokenizer, batched

    def sample(self, rows, params):
        from twinkle.data_format import SampledSequence, SampleResponse

        groups = [rows] if self.batched else [[r] for r in rows]
        out = []
        for group in groups:
            prompts = [list(r["input_ids"]) for r in group]
            width = max(len(p) for p in prompts)
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            sampled = params.temperature > 0
            self.model.eval()
            with torch.no_grad():
                result = self.model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=params.max_tokens,
                    do_sample=sampled,
                    temperature=params.temperature if sampled else None,
                    top_p=None,
                    top_k=None,
                    output_logits=True,
                    return_dict_in_generate=True,
                    pad_token_id=pad,
                    eos_token_id=self.tokenizer.eos_token_id,
                )
            new = result.sequences[:, width:]
            logps = torch.stack([torch.log_softmax(x.float(), -1) for x in result.logits], 1)
            for i in range(len(group)):
                tokens = new[i].tolist()
                end = next((k + 1 for k, t in enumerate(tokens) if t == self.tokenizer.eos_token_id), None)
                tokens = tokens[:end] if end else tokens
                lps = [[(t, float(logps[i, k, t]))] for k, t in enumerate(tokens)]
                reason = "stop" if end else "length"
                out.append(SampleResponse([SampledSequence(tokens, lps, "", reason)]))
        return out


def play(rollout, pool, seeds, params, delay: float):
    import multi_turn_grpo as task

    from twinkle_agentic.envs import EnvTool
    from twinkle_agentic.tools import ToolManager

    adapters = pool.get_adapters(len(seeds))
    starts = [a.reset(seed=s) for a, s in zip(adapters, seeds, strict=True)]
    tools = [EnvTool.from_env(Delayed(a, delay) if delay else a) for a in adapters]
    managers = [ToolManager(t, format="smollm2", timeout=30) for t in tools]
    prompts = [task.trajectory(s.observation, s.info["answer"]) for s in starts]
    return rollout(prompts, tool_manager=managers, sampling_params=params)


class Delayed:
    """An environment whose every step waits ``delay`` seconds first."""

    def __init__(self, env, delay: float):
        self.env, self.delay = env, delay

    def step(self, name, arguments):
        time.sleep(self.delay)
        return self.env.step(name, arguments)

    def tools(self):
        return self.env.tools()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", type=int, default=16)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--env-delay", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--smoke", action="store_true", help="2 trajectories, 1 round: checks the script")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.smoke:
        args.trajectories, args.rounds, args.max_tokens = 2, 1, 12
    if args.threads:
        torch.set_num_threads(args.threads)
    args.command = " ".join(sys.argv[1:])
    # the cookbook module parses its own command line on import: only a run folder of the bench's
    sys.argv = [sys.argv[0], "--output-dir", tempfile.mkdtemp(prefix="agentic-bench-")]
    import multi_turn_grpo as task

    from twinkle.data_format import SamplingParams
    from twinkle.loss import GRPOLoss
    from twinkle.sampler import TorchSampler
    from twinkle_agentic.envs import ArithmeticEnv, EnvPool
    from twinkle_agentic.rollout import MultiTurnRollout

    model = task.build_model()
    model.set_loss(GRPOLoss(epsilon=0.2))
    sampler = TorchSampler(model)
    template = sampler._template()
    lm = model.model.get_base_model() if hasattr(model.model, "get_base_model") else model.model
    pool = EnvPool(args.trajectories, env_cls=ArithmeticEnv)
    seeds = [2_000_000 + i for i in range(args.trajectories)]
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    sides = {
        "twinkle": sampler,
        "hf-sequential": GenerateSampler(lm, template.tokenizer, batched=False),
        "hf-batched": GenerateSampler(lm, template.tokenizer, batched=True),
    }
    results, played = {}, {}
    for name, side in sides.items():
        rollout = MultiTurnRollout(side, template, max_turns=args.max_turns, reward_fn=task.success)
        with torch.no_grad():  # the trainer's model on every side (its new adapter is zero)
            play(rollout, pool, seeds[:2], greedy, 0.0)  # warm-up
            runs = []
            for _ in range(args.rounds):
                records = play(rollout, pool, seeds, greedy, 0.0)
                m = rollout.metrics
                runs.append((m.total_seconds, m.turns, m.generated_tokens, m.env_seconds))
        played[name] = records
        seconds = statistics.median(r[0] for r in runs)
        turns, tokens = runs[0][1], runs[0][2]
        results[name] = {
            "seconds": seconds,
            "turns": turns,
            "generated_tokens": tokens,
            "turns_per_s": turns / seconds,
            "tokens_per_s": tokens / seconds,
            "success": sum(r["reward"] for r in records) / len(records),
        }
        print(name, results[name], flush=True)
    same = sum(
        a["input_ids"] == b["input_ids"] for a, b in zip(played["twinkle"], played["hf-batched"], strict=True)
    )

    steps = {}
    rollout = MultiTurnRollout(sampler, template, max_turns=args.max_turns, reward_fn=task.success)
    sampled = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=0)
    for delay in (0.0, args.env_delay):
        t0 = time.perf_counter()
        records = play(rollout, pool, seeds, sampled, delay)
        t1 = time.perf_counter()
        rewards = [r["reward"] for r in records]
        mean = sum(rewards) / len(rewards)
        model.forward_backward(inputs=records, old_logps=[r["old_logps"] for r in records],
                               advantages=[x - mean for x in rewards])  # fmt: skip
        model.clip_grad_and_step()
        t2 = time.perf_counter()
        m = rollout.metrics
        steps[delay] = {
            "step_seconds": t2 - t0,
            "sample_seconds": m.sample_seconds,
            "env_seconds": m.env_seconds,
            "train_seconds": t2 - t1,
            "env_share": m.env_seconds / (t2 - t0),
            "env_steps": m.tool_calls,
        }
        print("grpo step", delay, steps[delay], flush=True)
    write(args, results, steps, same)


def write(args, results, steps, same: int) -> None:
    base = results["twinkle"]
    lines = [
        f"# Multi-turn rollout throughput ({datetime.date.today().isoformat()})",
        "",
        f"CPU: {cpu_name()}, {torch.get_num_threads()} torch threads; torch {torch.__version__}, "
        f"Python {platform.python_version()}. Model: the bundled SmolLM2-135M-Instruct (fp32) with the "
        "cookbook's fresh LoRA adapter (zero: the base model's outputs) on every side.",
        f"Task: {args.trajectories} `ArithmeticEnv` episodes (fixed seeds), at most {args.max_turns} replies "
        f"of {args.max_tokens} tokens, greedy; median of {args.rounds} rounds after a warm-up.",
        f"Command: `python bench/agentic_rollout.py {args.command}`",
        "",
        "| side | seconds | turns | generated tokens | turns/s | tokens/s | twinkle's speed-up | success |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['seconds']:.2f} | {r['turns']} | {r['generated_tokens']} | {r['turns_per_s']:.2f} | "
            f"{r['tokens_per_s']:.1f} | {r['seconds'] / base['seconds']:.2f}x | {r['success']:.2f} |"
        )
    lines += [
        "",
        f"`twinkle` and `hf-batched` played identical token sequences in {same} of {args.trajectories} "
        "trajectories (greedy; a near-tie can flip between the two implementations' summation orders).",
        "",
        "## Share of a GRPO step spent waiting on environments",
        "",
        "One step: a sampled rollout (temperature 1) of the same episodes, then `forward_backward` and "
        "`clip_grad_and_step` with `GRPOLoss` on its trajectories.",
        "",
        "| env delay per step (s) | env steps | step (s) | sampling (s) | waiting on envs (s) | training (s) | env share |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for delay, s in steps.items():
        lines.append(
            f"| {delay:g} | {s['env_steps']} | {s['step_seconds']:.2f} | {s['sample_seconds']:.2f} | "
            f"{s['env_seconds']:.3f} | {s['train_seconds']:.2f} | {s['env_share']:.1%} |"
        )
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(
        json.dumps({"results": results, "steps": steps, "same": same}, indent=1)
    )
    print(text)


if __name__ == "__main__":
    main()
