"""Twinkle's on-policy GKD step against TRL's ``GKDTrainer``, and the teacher's top-k scoring
against a plain HF forward + ``topk``, on a CPU, side by side.

    pip install -e '.[bench]'    # TRL (trl >= 1.16)
    python bench/gkd_vs_trl.py --steps 10 --out bench/results/gkd-vs-trl-MACHINE-DATE.md
    python bench/gkd_vs_trl.py --model-id DIR --steps 2 --out /tmp/gkd.md   # checks the script

Both sides train the same thing, each side in its own process (peak RSS is per process):

- student and teacher: the bundled SmolLM2-135M-Instruct (``--model-id`` another folder) for
  both, fp32 weights; the student trains a LoRA (r 8, alpha 32, every linear layer, dropout 0).
  TRL's ``GKDConfig`` turns on ``bf16`` (CPU autocast) and ``gradient_checkpointing`` by default:
  both are passed as False, so TRL runs fp32 without recomputation, as Twinkle does;
- the step, fully on-policy on both sides (TRL: ``lmbda=1``): ``--prompts`` identity prompts, one
  completion each of exactly ``--max-tokens`` tokens at temperature 1 (no early stop: the
  end-of-sequence token is suppressed on neither side, so the lengths are reported), the teacher's
  distributions on the sampled tokens, generalized JSD with ``--beta`` and temperature 1, AdamW
  (``--lr``) and gradient norm clipped to 1. TRL compares the full vocabulary; Twinkle the
  teacher's top ``--topk`` tokens (its documented loss, what a remote teacher sends);
- teacher scoring (Twinkle's side only): the teacher's top-64 log-probabilities on the last
  step's rows (the sampled completions of unequal prompts, as a step scores them) by
  ``teacher_topk`` (the completion positions) and by
  ``TorchSampler(teacher).sample(rows, SamplingParams(max_tokens=0, prompt_logprobs=64))``
  (every position), both through ``twinkle.model.scoring_topk`` (one inference-only forward of
  the rows packed end to end with their shared prefix once, the head at the scored positions
  only), against a plain HF forward of the padded batch + ``log_softmax`` + ``topk``. The rows'
  lengths are reported.

Measured per side: steps per second after ``--warmup`` steps, peak resident memory; for Twinkle
also the peak after each part of the first step (models and sampler built, sampling, the
teacher's scoring, the student's forward and backward, the optimizer step), which shows which
part sets it. Each model holds its fp32 weights once: the student's sampler decodes from the
dense weights, so sharing the student frees its oneDNN-packed copies (``cpu_gemm.keep_dense``),
and the teacher only scores. Targets
(issue 63): Twinkle >= 2x TRL's steps/s at <= 0.8x its peak memory; scoring >= 1.5x the plain
forward. Writes a markdown report to ``--out`` and prints it; it times things, so it is not part
of the test suite."""

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from twinkle.utils.memory import peak_rss_mib

HERE = Path(__file__).resolve()


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-id", default=None, help="model folder; default the bundled SmolLM2-135M-Instruct")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--beta", type=float, default=0.5)
    p.add_argument("--topk", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--side", choices=("twinkle", "trl"), help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def prompts(n: int) -> list[dict]:
    from twinkle.hub.dataset import resolve_dataset

    rows = [r for r in resolve_dataset("self-cognition") if r.get("tag") == "en"][:n]
    return [{"messages": [{"role": "user", "content": r["query"]}]} for r in rows]


def model_path(model_id):
    from twinkle.hub.model import resolve_model  # the bundled model as an HF folder

    return str(resolve_model(model_id))


def twinkle_side(a) -> dict:
    import torch
    from peft import LoraConfig

    import twinkle
    from twinkle.data_format import SamplingParams
    from twinkle.loss import GKDLoss
    from twinkle.model import TransformersModel
    from twinkle.model.teacher import padded, teacher_topk
    from twinkle.sampler import TorchSampler

    twinkle.initialize(mode="local")
    student = TransformersModel(model_id=a.model_id)
    student.add_adapter_to_model("default", LoraConfig(r=8, lora_alpha=32, target_modules="all-linear"))
    student.set_optimizer("AdamW", lr=a.lr)
    student.set_loss(GKDLoss(beta=a.beta, topk=a.topk))
    teacher = TransformersModel(model_id=a.model_id)  # frozen: no adapter, no optimizer
    sampler = TorchSampler(student)
    batch, times, lengths, scoring = prompts(a.prompts), [], [], {}
    phases = {"models and sampler built": peak_rss_mib()}

    def phase(name, step):
        if step == 0:
            phases[name] = peak_rss_mib()

    for step in range(a.steps):
        t0 = time.perf_counter()
        params = SamplingParams(max_tokens=a.max_tokens, temperature=1.0, seed=step)
        rows = [s.new_input_feature for r in sampler.sample(batch, params) for s in r.sequences]
        phase("sampling", step)
        scores = teacher_topk(teacher, rows, a.topk)
        phase("teacher scoring", step)
        student.forward_backward(inputs=rows, **scores)
        phase("forward and backward", step)
        student.clip_grad_and_step(max_grad_norm=1.0)
        phase("optimizer step", step)
        times.append(time.perf_counter() - t0)
        lengths.append(sum(int((torch.tensor(r["labels"]) != -100).sum()) for r in rows))
    train_peak = peak_rss_mib()
    ids, mask, _ = padded(rows, 0)
    lm = teacher.model

    def plain():
        with torch.no_grad():
            torch.log_softmax(lm(input_ids=ids, attention_mask=mask).logits.float(), -1).topk(a.topk, -1)

    timers = {
        "plain HF forward + topk": plain,
        "teacher_topk": lambda: teacher_topk(teacher, rows, a.topk),
        "TorchSampler prompt_logprobs": lambda: TorchSampler(teacher).sample(
            rows, SamplingParams(max_tokens=0, prompt_logprobs=a.topk)
        ),
    }
    for name, fn in timers.items():
        fn()
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t0)
        scoring[name] = statistics.median(runs)
    return {
        "times": times,
        "completion_tokens": lengths,
        "scoring": scoring,
        "scored_lengths": [len(r["input_ids"]) for r in rows],
        "train_peak_mib": train_peak,
        "phase_peaks_mib": phases,
    }


def trl_side(a) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    try:
        from trl import GKDConfig, GKDTrainer
    except ImportError:
        from trl.experimental.gkd import GKDConfig, GKDTrainer

    path = model_path(a.model_id)
    tok = AutoTokenizer.from_pretrained(path)
    rows = [{"messages": p["messages"] + [{"role": "assistant", "content": ""}]} for p in prompts(a.prompts)]
    data = Dataset.from_list(rows * a.steps)
    times = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            times.append(time.perf_counter() - self.t0)

    config = GKDConfig(
        output_dir="/tmp/gkd-bench-trl", per_device_train_batch_size=a.prompts, max_steps=a.steps,
        learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
        lmbda=1.0, beta=a.beta, temperature=1.0, max_new_tokens=a.max_tokens, bf16=False,
        gradient_checkpointing=False, use_cpu=True, report_to=[], logging_steps=1, save_strategy="no",
        disable_dropout=True, seq_kd=False,
    )  # fmt: skip
    trainer = GKDTrainer(
        model=AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32),
        teacher_model=AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32),
        args=config, train_dataset=data, processing_class=tok, callbacks=[Timer()],
        peft_config=LoraConfig(r=8, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0),
    )  # fmt: skip
    trainer.train()
    return {"times": times}


def run_side(side: str, a) -> dict:
    command = [sys.executable, str(HERE), "--side", side, "--steps", str(a.steps), "--prompts", str(a.prompts),
               "--max-tokens", str(a.max_tokens), "--beta", str(a.beta), "--topk", str(a.topk), "--lr", str(a.lr),
               "--threads", str(a.threads)] + (["--model-id", a.model_id] if a.model_id else [])  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{side} side failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return f"{fields.get('Model name', platform.processor()).strip()} (family {fields.get('CPU family', '?').strip()})"


def report(a, ours: dict, theirs: dict) -> str:
    rate = lambda t: 1 / statistics.median(t[a.warmup :] or t)  # noqa: E731
    ours_rate, trl_rate = rate(ours["times"]), rate(theirs["times"])
    lines = [
        f"# On-policy GKD: Twinkle vs TRL GKDTrainer ({cpu_name()})", "",
        f"{a.prompts} prompts x {a.max_tokens} tokens a step, beta {a.beta}, fp32 both sides (TRL bf16=False, "
        f"gradient_checkpointing=False), LoRA r 8, {a.steps} steps, median after {a.warmup}, {a.threads} threads.", "",
        "| side | steps/s | peak RSS while training (MiB) |", "|---|---|---|",
        f"| Twinkle (top-{a.topk}) | {ours_rate:.3f} | {ours['train_peak_mib']:.0f} |",
        f"| TRL GKDTrainer (full vocabulary) | {trl_rate:.3f} | {theirs['train_peak_mib']:.0f} |", "",
        f"Twinkle/TRL: {ours_rate / trl_rate:.2f}x steps/s (target >= 2), "
        f"{ours['train_peak_mib'] / theirs['train_peak_mib']:.2f}x memory (target <= 0.8).", "",
        "| teacher scoring, top-64 | seconds | vs plain |", "|---|---|---|",
    ]  # fmt: skip
    plain = ours["scoring"]["plain HF forward + topk"]
    for name, seconds in ours["scoring"].items():
        lines.append(f"| {name} | {seconds:.3f} | {plain / seconds:.2f}x |")
    lines += ["", f"Scored rows: {ours['scored_lengths']} tokens (prompt and completion).", ""]
    steps = ", ".join(f"{name} {mib:.0f}" for name, mib in ours["phase_peaks_mib"].items())
    lines.append(f"Twinkle's peak RSS (MiB) after each part of the first step: {steps}.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    a = parse(argv)
    if a.side:
        import torch

        torch.set_num_threads(a.threads)
        out = twinkle_side(a) if a.side == "twinkle" else trl_side(a)
        out.setdefault("train_peak_mib", peak_rss_mib())
        print(json.dumps(out))
        return
    ours, theirs = run_side("twinkle", a), run_side("trl", a)
    text = report(a, ours, theirs)
    print(text)
    if a.out:
        Path(a.out).write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
