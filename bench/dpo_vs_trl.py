"""Twinkle's DPO step against TRL's ``DPOTrainer`` with PEFT LoRA, on a CPU, side by side.

    pip install -e '.[bench]'    # TRL
    python bench/dpo_vs_trl.py --steps 30 --rounds 3 --out bench/results/dpo-vs-trl-MACHINE-DATE.md
    python bench/dpo_vs_trl.py --model-id DIR --steps 2 --rounds 1 --out /tmp/dpo.md   # checks the script

Both sides train the same thing, each side in its own process (peak RSS is per process), the
sides alternating first in successive rounds, medians reported (a shared machine drifts by tens of
percent over minutes):

- model: the bundled SmolLM2-135M-Instruct (``--model-id`` another folder), fp32 weights on both.
  TRL's ``DPOConfig`` turns on ``bf16`` (CPU autocast) and ``gradient_checkpointing`` by default:
  both are passed as False here, so TRL runs fp32 without recomputation, as Twinkle does (its
  ``--activation-checkpointing auto`` recomputes only a batch that would not fit in memory);
- rows: the bundled ``self-cognition-dpo`` training pairs filled by ``SelfCognitionDPOProcessor``
  (the cookbook's defaults), in order, no shuffling (TRL: ``train_sampling_strategy='sequential'``);
  TRL gets them as conversational rows (system and user turns as the prompt, the reply as
  chosen/rejected) and renders them with the tokenizer's chat template, as Twinkle's template does;
- LoRA: r 8, alpha 32, every linear layer, dropout 0 on both (TRL's ``disable_dropout=True``,
  its default, switches off every dropout, the LoRA one included: 0 on Twinkle's side too);
- the step: the reference is the base model with the adapter off on both sides (TRL does this for
  a PEFT model without ``ref_model``), sigmoid DPO loss, ``--beta``, ``--pairs`` pairs a step,
  AdamW (``--lr``, betas 0.9/0.999, eps 1e-8, weight decay 0) at a constant learning rate with no
  warm-up, gradient norm clipped to 1, ``--steps`` steps.

Measured per side: pairs per second over the steps after ``--warmup``, peak resident memory, the
loss of every step; on Twinkle's side also the reference pass (``forward_only(disable_lora=True)``)
against the policy's forward+backward on the same batch. Targets (issue 44): Twinkle at least 2x
TRL's pairs/s and at most 0.8x its peak memory; the reference pass at most 0.35x the policy's
forward+backward. The losses agree in distribution, not to rounding: TRL tokenizes the prompt and
each reply apart and joins them, Twinkle renders each side whole (a token may differ at the seam;
each side's supervised tokens are reported), and the kernels differ.

Writes a markdown report to ``--out`` (and ``.json`` beside it) and prints it. It times things, so
it is not part of the test suite."""

import argparse
import datetime
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
NAME, AUTHOR = "twinkle大模型", "ModelScope社区"  # the cookbook's identity


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-id", default=None, help="model folder; default the bundled SmolLM2-135M-Instruct")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per side")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the throughput")
    p.add_argument("--pairs", type=int, default=4, help="preference pairs per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--rounds", type=int, default=1, help="run the pair this often, alternating the order")
    p.add_argument("--out", default="output/dpo-vs-trl.md")
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # one side, in its own process
    p.add_argument("--result", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.steps <= opts.warmup:
        p.error(f"--steps {opts.steps} must be above --warmup {opts.warmup}")
    return opts


def preference_rows(count: int) -> list[dict]:
    """The first ``count`` bundled training pairs (repeating), as messages: ``positive`` and
    ``negative`` trajectories sharing their prompt."""
    from twinkle.dataset import Dataset, DatasetMeta
    from twinkle.preprocessor import SelfCognitionDPOProcessor

    dataset = Dataset(DatasetMeta("self-cognition-dpo", data_slice=range(count)))
    dataset.map(SelfCognitionDPOProcessor(NAME, AUTHOR))
    return [dataset[i] for i in range(len(dataset))]


def twinkle_side(opts: argparse.Namespace, work: Path) -> dict:
    import torch
    from peft import LoraConfig

    import twinkle
    from twinkle.dataloader import DataLoader
    from twinkle.dataset import Dataset, DatasetMeta
    from twinkle.kernel import kernelize
    from twinkle.loss import DPOLoss
    from twinkle.model import TransformersModel
    from twinkle.preprocessor import SelfCognitionDPOProcessor
    from twinkle.runtime import RunDefaults

    twinkle.initialize(seed=opts.seed, run=RunDefaults(output_dir=str(work), report_to=()))
    dataset = Dataset(DatasetMeta("self-cognition-dpo", data_slice=range(opts.steps * opts.pairs)))
    dataset.set_template("Template", model_id=opts.model_id, max_length=1024)
    dataset.map(SelfCognitionDPOProcessor(NAME, AUTHOR))
    dataset.encode()
    model = kernelize(TransformersModel(model_id=opts.model_id, dtype=torch.float32))
    lora = LoraConfig(
        r=8, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    model.add_adapter_to_model("default", lora)
    model.set_optimizer("AdamW", lr=opts.lr, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    model.set_loss(DPOLoss(beta=opts.beta))
    steps = []
    for batch in DataLoader(dataset=dataset, batch_size=opts.pairs):
        start = time.perf_counter()
        ref = model.forward_only(inputs=batch, disable_lora=True)
        ref["logps"]  # noqa: B018  (read now: the timing holds its computation)
        mid = time.perf_counter()
        loss = model.forward_backward(inputs=batch, ref_outputs=ref)
        policy = time.perf_counter()
        model.clip_grad_and_step(max_grad_norm=1.0)
        end = time.perf_counter()
        tokens = sum(
            sum(1 for t in side["labels"] if t != -100)
            for row in batch
            for side in (row["positive"], row["negative"])
        )
        steps.append({"loss": loss, "s": end - start, "ref_s": mid - start, "policy_s": policy - mid,
                      "supervised_tokens": tokens})  # fmt: skip
    return {"steps": steps}


def trl_side(opts: argparse.Namespace, work: Path) -> dict:
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from twinkle.hub import resolve_model

    path = str(resolve_model(opts.model_id))
    rows = []
    for pair in preference_rows(opts.steps * opts.pairs):
        chosen, rejected = pair["positive"]["messages"], pair["negative"]["messages"]
        rows.append({"prompt": chosen[:-1], "chosen": chosen[-1:], "rejected": rejected[-1:]})
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = DPOConfig(
        output_dir=str(work), per_device_train_batch_size=opts.pairs, max_steps=opts.steps,
        learning_rate=opts.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
        beta=opts.beta, loss_type=["sigmoid"], max_length=1024,
        bf16=False, fp16=False, gradient_checkpointing=False,  # DPOConfig's defaults are True
        use_cpu=True, disable_dropout=True, train_sampling_strategy="sequential", seed=opts.seed,
        logging_steps=1, save_strategy="no", report_to=[], dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    lora = LoraConfig(
        r=8, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    steps: list[dict] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            steps.append({"s": time.perf_counter() - self.start})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs and steps:
                steps[-1]["loss"] = float(logs["loss"])

    trainer = DPOTrainer(
        model=model, args=config, train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer,
        peft_config=lora, callbacks=[Timer()],
    )  # fmt: skip
    lengths = [len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in trainer.train_dataset]
    trainer.train()
    for i, step in enumerate(steps):
        step["supervised_tokens"] = sum(lengths[i * opts.pairs : (i + 1) * opts.pairs])
    return {"steps": steps}


def run_side(opts: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(opts.threads)
    torch.manual_seed(opts.seed)
    with tempfile.TemporaryDirectory() as work:
        result = (twinkle_side if opts.side == "twinkle" else trl_side)(opts, Path(work))
    result["peak_rss_mib"] = peak_rss_mib()
    Path(opts.result).write_text(json.dumps(result))


def launch(opts: argparse.Namespace, side: str, folder: Path) -> dict:
    out = folder / f"{side}.json"
    argv = [sys.executable, str(HERE), "--side", side, "--result", str(out)]
    for key in ("model_id", "steps", "warmup", "pairs", "lr", "beta", "threads", "seed"):
        value = getattr(opts, key)
        if value is not None:
            argv += [f"--{key.replace('_', '-')}", str(value)]
    env = {"OMP_NUM_THREADS": str(opts.threads), "TWINKLE_CACHE": str(folder / "cache")}
    done = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"error: the {side} side failed:\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def summary(result: dict, opts: argparse.Namespace) -> dict:
    timed = result["steps"][opts.warmup :]
    out = {
        "pairs_per_s": opts.pairs * len(timed) / sum(s["s"] for s in timed),
        "peak_rss_mib": result["peak_rss_mib"],
        "losses": [s.get("loss") for s in result["steps"]],
        "last5_loss": statistics.fmean(s["loss"] for s in result["steps"][-5:] if "loss" in s),
        "supervised_tokens": sum(s["supervised_tokens"] for s in result["steps"]),
    }
    if "ref_s" in timed[0]:
        out["ref_over_policy"] = sum(s["ref_s"] for s in timed) / sum(s["policy_s"] for s in timed)
    return out


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def report(opts: argparse.Namespace, rounds: list[dict]) -> str:
    tw = [r["twinkle"] for r in rounds]
    tr = [r["trl"] for r in rounds]
    speed = statistics.median(a["pairs_per_s"] / b["pairs_per_s"] for a, b in zip(tw, tr, strict=True))
    memory = statistics.median(a["peak_rss_mib"] / b["peak_rss_mib"] for a, b in zip(tw, tr, strict=True))
    ref = statistics.median(a["ref_over_policy"] for a in tw)
    import torch
    import trl

    lines = [
        f"# DPO: Twinkle vs TRL DPOTrainer ({datetime.date.today()})",
        "",
        f"CPU: {cpu_name()} ({os.cpu_count()} cores), {opts.threads} threads; torch {torch.__version__}, "
        f"trl {trl.__version__}; model {opts.model_id or 'bundled SmolLM2-135M-Instruct'} fp32; "
        f"{opts.steps} steps of {opts.pairs} pairs (first {opts.warmup} untimed), AdamW lr {opts.lr} constant, "
        f"beta {opts.beta}, LoRA r 8 alpha 32 all-linear dropout 0; {len(rounds)} round(s), medians.",
        "",
        "| | Twinkle | TRL | ratio | target |",
        "|---|---|---|---|---|",
        f"| pairs/s | {statistics.median(a['pairs_per_s'] for a in tw):.3f} | "
        f"{statistics.median(b['pairs_per_s'] for b in tr):.3f} | {speed:.2f}x | >= 2x |",
        f"| peak RSS (MiB) | {statistics.median(a['peak_rss_mib'] for a in tw):.0f} | "
        f"{statistics.median(b['peak_rss_mib'] for b in tr):.0f} | {memory:.2f}x | <= 0.8x |",
        f"| reference pass / policy fwd+bwd | {ref:.3f} | | | <= 0.35 |",
        f"| mean loss of the last 5 steps | {tw[0]['last5_loss']:.4f} | {tr[0]['last5_loss']:.4f} | | |",
        f"| supervised tokens (all steps) | {tw[0]['supervised_tokens']} | {tr[0]['supervised_tokens']} | | |",
        "",
        "Losses per step (round 1):",
        "",
        f"- Twinkle: {[round(x, 4) for x in tw[0]['losses']]}",
        f"- TRL: {[round(x, 4) if x is not None else None for x in tr[0]['losses']]}",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    opts = parse()
    if opts.side:
        run_side(opts)
        return
    rounds = []
    with tempfile.TemporaryDirectory() as folder:
        for index in range(opts.rounds):
            order = SIDES if index % 2 == 0 else SIDES[::-1]
            rounds.append({side: summary(launch(opts, side, Path(folder)), opts) for side in order})
    text = report(opts, rounds)
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"options": vars(opts), "rounds": rounds}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
