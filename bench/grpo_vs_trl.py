"""Twinkle's GRPO step against TRL's ``GRPOTrainer`` with PEFT LoRA, on a CPU, side by side.

    pip install -e '.[bench]'    # TRL
    python bench/grpo_vs_trl.py --steps 10 --out bench/results/grpo-vs-trl-MACHINE-DATE.md
    python bench/grpo_vs_trl.py --model-id DIR --steps 2 --warmup 1 --prompts 1 --num-generations 2 \\
        --max-tokens 4 --out /tmp/grpo.md   # checks the script (a tiny model)

Both sides train the same thing, each in its own process (peak RSS is per process):

- model: the bundled SmolLM2-135M-Instruct (``--model-id`` another folder), fp32 on both. TRL's
  ``GRPOConfig`` turns on ``gradient_checkpointing`` by default and ``bf16`` where the device has
  it: both are passed as False here (with ``use_cpu=True``), so TRL runs fp32 without
  recomputation, as Twinkle does;
- prompts: the bundled ``arithmetic-gsm8k`` training problems in order through
  ``GSM8KProcessor`` with the cookbook's system prompt, ``--prompts`` a step, ``--num-generations``
  completions each, at most ``--max-tokens`` tokens, temperature 1, top-p 1; TRL gets the same
  messages as conversational prompts (rendered by the tokenizer's chat template on both sides);
- reward: ``GSM8KAccuracyReward`` + ``GSM8KFormatReward`` on both; advantages scaled by the
  group's std; the loss: GRPO's token-level clip (epsilon 0.2), no KL (``beta`` 0), one update
  per generation (TRL's ``num_iterations=1``; ``loss_type='grpo'``: per-sequence then batch mean);
- LoRA: r 8, alpha 32, every linear layer, dropout 0; AdamW (``--lr``, weight decay 0) at a
  constant learning rate, gradients clipped to norm 1, ``--steps`` steps.

Measured per side: seconds per step (median over the steps after ``--warmup``), split into
generation (Twinkle: ``sync_weights`` + ``sample``; TRL: its generation call, timed by wrapping
it) and the rest (scoring + training), peak resident memory, the mean reward per step. Targets
(issue 45): Twinkle at least 2x TRL's steps per second and at most 0.8x its peak memory.

Writes a markdown report to ``--out`` (and ``.json`` beside it) and prints it. It times things, so
it is not part of the test suite."""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from twinkle.utils.memory import peak_rss_mib

HERE = Path(__file__).resolve()
SIDES = ("twinkle", "trl")
SYSTEM = (
    "You solve math word problems. Reply with the calculation, then the final answer after '####'.\n"
    "Example: Tom has 5 apples and gets 3 more. How many apples does Tom have?\n5 + 3 = 8\n#### 8"
)  # the cookbook's (cookbook/rl/grpo_math.py)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-id", default=None, help="model folder; default the bundled SmolLM2-135M-Instruct")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing")
    p.add_argument("--prompts", type=int, default=2, help="prompts per step")
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--out", default="output/grpo-vs-trl.md")
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # one side, in its own process
    p.add_argument("--result", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.steps <= opts.warmup:
        p.error(f"--steps {opts.steps} must be above --warmup {opts.warmup}")
    return opts


def prompts(opts: argparse.Namespace) -> list[dict]:
    from twinkle.hub.dataset import resolve_dataset
    from twinkle.preprocessor.llm import GSM8KProcessor

    rows = resolve_dataset("arithmetic-gsm8k", split="train")
    processor = GSM8KProcessor(system=SYSTEM)
    return [processor(dict(rows[i]), i) for i in range(opts.steps * opts.prompts)]


def score(rows: list[dict]) -> list[float]:
    from twinkle.reward import GSM8KAccuracyReward, GSM8KFormatReward

    return [a + f for a, f in zip(GSM8KAccuracyReward()(rows), GSM8KFormatReward()(rows), strict=True)]


def twinkle_side(opts: argparse.Namespace, work: Path) -> dict:
    import torch
    from peft import LoraConfig

    import twinkle
    from twinkle.advantage import GRPOAdvantage
    from twinkle.checkpoint_engine import CheckpointEngineManager
    from twinkle.data_format import SamplingParams
    from twinkle.loss import GRPOLoss
    from twinkle.model import TransformersModel
    from twinkle.runtime import RunDefaults
    from twinkle.sampler import TorchSampler

    twinkle.initialize(seed=opts.seed, run=RunDefaults(output_dir=str(work), report_to=()))
    model = TransformersModel(model_id=opts.model_id, dtype=torch.float32)
    lora = LoraConfig(
        r=8, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    model.add_adapter_to_model("default", lora)
    model.set_optimizer("AdamW", lr=opts.lr, weight_decay=0.0)
    model.set_loss(GRPOLoss(epsilon=0.2))
    sampler = TorchSampler(model)
    engine = CheckpointEngineManager(model=model, sampler=sampler)
    data, g = prompts(opts), opts.num_generations
    steps = []
    for i in range(opts.steps):
        start = time.perf_counter()
        engine.sync_weights()
        params = SamplingParams(max_tokens=opts.max_tokens, num_samples=g, seed=opts.seed + i)
        responses = sampler.sample(data[i * opts.prompts : (i + 1) * opts.prompts], params)
        generated = time.perf_counter()
        seqs = [s for r in responses for s in r.sequences]
        rows = [s.new_input_feature for s in seqs]
        rewards = score(rows)
        advantages = GRPOAdvantage()(rewards, num_generations=g, scale="group")
        old = [[lp[0][1] for lp in s.logprobs] for s in seqs]
        model.forward_backward(inputs=rows, old_logps=old, advantages=advantages)
        model.clip_grad_and_step(max_grad_norm=1.0)
        end = time.perf_counter()
        steps.append({"s": end - start, "gen_s": generated - start, "reward": statistics.fmean(rewards),
                      "tokens": sum(len(s.tokens) for s in seqs)})  # fmt: skip
    return {"steps": steps}


def trl_side(opts: argparse.Namespace, work: Path) -> dict:
    import datasets
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from twinkle.hub import resolve_model

    path = str(resolve_model(opts.model_id))
    rows = [{"prompt": p["messages"], "ground_truth": p["user_data"][0][1]} for p in prompts(opts)]
    times: dict[str, list[float]] = {"gen": [], "begin": [], "end": []}
    rewards: list[float] = []

    def reward(prompts, completions, ground_truth, **kwargs):
        trajectories = [
            {"messages": [*p, *c], "user_data": [("ground_truth", t)]}
            for p, c, t in zip(prompts, completions, ground_truth, strict=True)
        ]
        values = score(trajectories)
        rewards.append(statistics.fmean(values))
        return values

    config = GRPOConfig(
        output_dir=str(work), use_cpu=True, bf16=False, gradient_checkpointing=False, seed=opts.seed,
        per_device_train_batch_size=opts.prompts * opts.num_generations, num_generations=opts.num_generations,
        max_completion_length=opts.max_tokens, temperature=1.0, top_p=1.0, learning_rate=opts.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, beta=0.0,
        epsilon=0.2, loss_type="grpo", scale_rewards="group", num_iterations=1, max_steps=opts.steps,
        logging_steps=1, report_to=[], save_strategy="no", disable_dropout=True, shuffle_dataset=False,
        dataloader_num_workers=0,
    )  # fmt: skip
    lora = LoraConfig(
        r=8, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    trainer = GRPOTrainer(model=path, reward_funcs=reward, args=config,
                          train_dataset=datasets.Dataset.from_list(rows), peft_config=lora)  # fmt: skip
    for name in ("_generate_single_turn", "_generate"):  # the generation call, whichever TRL has
        original = getattr(trainer, name, None)
        if original is not None:

            def timed(*args, _original=original, **kwargs):
                start = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    times["gen"].append(time.perf_counter() - start)

            setattr(trainer, name, timed)
            break

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            times["begin"].append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            times["end"].append(time.perf_counter())

    trainer.add_callback(Clock())
    trainer.train()
    steps = []
    for i, (b, e) in enumerate(zip(times["begin"], times["end"], strict=True)):
        gen = times["gen"][i] if len(times["gen"]) == len(times["begin"]) else None
        steps.append({"s": e - b, "gen_s": gen, "reward": rewards[i] if i < len(rewards) else None})
    return {"steps": steps}


def run_side(opts: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(opts.threads)
    with tempfile.TemporaryDirectory() as work:
        result = (twinkle_side if opts.side == "twinkle" else trl_side)(opts, Path(work))
    result["peak_rss_mb"] = peak_rss_mib()
    Path(opts.result).write_text(json.dumps(result))


def launch(opts: argparse.Namespace, side: str, folder: Path) -> dict:
    out = folder / f"{side}.json"
    argv = [a for a in sys.argv[1:] if a not in ("--side", "--result")]
    env = {**os.environ, "OMP_NUM_THREADS": str(opts.threads)}
    command = [sys.executable, str(HERE), *argv, "--side", side, "--result", str(out)]
    subprocess.run(command, check=True, env=env)
    return json.loads(out.read_text())


def summary(result: dict, warmup: int) -> dict:
    timed = result["steps"][warmup:]
    gen = [s["gen_s"] for s in timed if s["gen_s"] is not None]
    step_s = statistics.median(s["s"] for s in timed)
    return {
        "step_s": step_s,
        "gen_s": statistics.median(gen) if len(gen) == len(timed) else None,
        "steps_per_s": 1 / step_s,
        "peak_rss_mb": result["peak_rss_mb"],
        "rewards": [s["reward"] for s in result["steps"]],
    }


def report(opts: argparse.Namespace, sides: dict[str, dict]) -> str:
    fmt = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
    lines = [
        f"# GRPO step: Twinkle vs TRL GRPOTrainer ({platform.processor() or platform.machine()}, "
        f"{opts.threads} threads)",
        "",
        f"model {opts.model_id or 'SmolLM2-135M-Instruct'} fp32, {opts.prompts} prompts x {opts.num_generations} "
        f"generations, max_tokens {opts.max_tokens}, lr {opts.lr}, {opts.steps} steps ({opts.warmup} warm-up)",
        "",
        "| side | s/step | generation s/step | rest s/step | steps/s | peak RSS MB |",
        "|---|---|---|---|---|---|",
    ]
    for side, s in sides.items():
        rest = None if s["gen_s"] is None else s["step_s"] - s["gen_s"]
        lines.append(f"| {side} | {fmt(s['step_s'])} | {fmt(s['gen_s'])} | {fmt(rest)} | "
                     f"{s['steps_per_s']:.3f} | {s['peak_rss_mb']:.0f} |")  # fmt: skip
    tw, trl = sides["twinkle"], sides["trl"]
    lines += ["", f"speed-up (steps/s): {tw['steps_per_s'] / trl['steps_per_s']:.2f}x (target >= 2x); "
              f"memory: {tw['peak_rss_mb'] / trl['peak_rss_mb']:.2f}x (target <= 0.8x)"]  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    opts = parse()
    if opts.side:
        run_side(opts)
        return
    with tempfile.TemporaryDirectory() as folder:
        sides = {side: summary(launch(opts, side, Path(folder)), opts.warmup) for side in SIDES}
    text = report(opts, sides)
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"options": vars(opts), "sides": sides}, indent=2))
    print(text)


if __name__ == "__main__":
    main()
