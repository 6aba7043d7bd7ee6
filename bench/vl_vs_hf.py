"""Vision-language LoRA SFT: Twinkle against Hugging Face ``Trainer`` + PEFT, on a CPU, side by side.

    python bench/vl_vs_hf.py --steps 30 --rounds 3 --out bench/results/vl-vs-hf-MACHINE-DATE.md
    python bench/vl_vs_hf.py --steps 2 --warmup 1 --rounds 1 --out /tmp/vl.md   # checks the script

Both sides train the same thing, each side in its own process (peak RSS is per process), the
sides alternating first in successive rounds, medians reported (a shared machine drifts by tens of
percent over minutes):

- model: the cookbook's small Qwen2.5-VL (``cookbook/mm/vl_checkpoint.py``: SmolLM2-135M's
  embeddings, tied head and first 4 layers behind a 2-block vision tower with 4-pixel patches),
  made once in the Twinkle cache, or ``--model-id`` another Qwen2.5-VL folder; fp32 weights,
  ``Qwen2_5_VLForConditionalGeneration`` on both sides, no gradient checkpointing on either (the
  Trainer's ``activation_checkpointing=False``; Twinkle's ``auto`` recomputes only a batch that
  would not fit in memory), every dropout 0 (the model's attention dropout is 0, the LoRA's too);
- rows: the bundled digits and shapes (``twinkle.dataset.digits``, 312 training pictures, a
  question and a short answer each), in file order on both sides (the Trainer's
  ``train_sampling_strategy='sequential'``), ``--image-size`` pixels a side (32, the bundled size:
  16 visual tokens a picture; 64: 64 tokens). Each row is encoded when it is read, on both sides,
  by the same template (``Qwen2_5VLTemplate``: the model's tokenizer, chat template and PIL image
  processor); transformers' ``Qwen2_5_VLProcessor`` itself needs ``torchvision``, which a
  CPU-only install cannot have. The Trainer side's collator pads the rows on the right, joins
  their ``pixel_values`` and ``image_grid_thw`` and adds ``mm_token_type_ids`` (what the
  processor returns, without which transformers 5 gives image tokens plain positions);
- LoRA: r 8, alpha 32, dropout 0, every linear layer of the language model (``all-linear`` with
  the vision tower and projector excluded, ``twinkle.model.vision.VISION_MODULES``, the same
  config object on both sides), the vision tower frozen; the same seed before the adapter is made;
- the step: ``--batch-size`` pictures, mean cross-entropy over the reply tokens, AdamW (``--lr``,
  betas 0.9/0.999, eps 1e-8, weight decay 0) at a constant learning rate with no warm-up,
  gradient norm clipped to 1. Twinkle runs as ``cookbook/mm/fsdp2.py`` does, with ``kernelize``.

Measured per side: samples per second from the median step time after ``--warmup`` steps (a step
from the end of the one before to the end of this one, so reading and encoding the rows counts on
both sides: the Trainer fetches a batch before its ``on_step_begin``), peak resident memory, the
memory resident before the model loads (Python, torch, transformers, PEFT, ``datasets``, the
tokenizer and image processor: the same modules on both sides; with the fp32 weights the model
maps in, a floor under either side's peak), that peak less the memory resident just before the
first step (what the steps add: activations, gradients, optimizer state; on the Trainer's side
the weights as well, which transformers maps from the checkpoint and the first step reads in,
where Twinkle reads them when it packs the frozen ones), the loss of every step. Target (issue
64): Twinkle at least 2x the Trainer's samples/s at at most 0.6x its peak memory. The losses
should agree closely (same weights, rows, LoRA initialisation and optimizer), not to rounding:
the kernels differ.

Writes a markdown report to ``--out`` (and ``.json`` beside it) and prints it. It times things, so
it is not part of the test suite."""

import argparse
import base64
import datetime
import io
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
SIDES = ("twinkle", "hf_trainer")
MODEL_CLS = "Qwen2_5_VLForConditionalGeneration"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-id", default=None, help="a Qwen2.5-VL folder; default the cookbook's small one")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per side")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the throughput")
    p.add_argument("--batch-size", type=int, default=8, help="pictures per step")
    p.add_argument("--image-size", type=int, default=32, help="pixels a side the pictures are scaled to")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--rounds", type=int, default=1, help="run the pair this often, alternating the order")
    p.add_argument("--out", default="output/vl-vs-hf.md")
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # one side, in its own process
    p.add_argument("--result", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.steps <= opts.warmup:
        p.error(f"--steps {opts.steps} must be above --warmup {opts.warmup}")
    return opts


class PictureRow:
    """A bundled digits row -> its conversation, the picture scaled to ``size`` pixels a side (a
    ``map`` function on the Twinkle side, called per row on the Trainer side)."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, row: dict) -> dict:
        from twinkle.dataset.digits import digit_trajectory

        if self.size != 32:  # the bundled pictures are 32x32
            from PIL import Image

            picture = Image.open(io.BytesIO(base64.b64decode(row["image"]))).convert("RGB")
            out = io.BytesIO()
            picture.resize((self.size, self.size), Image.Resampling.BICUBIC).save(out, format="PNG")
            row = {**row, "image": base64.b64encode(out.getvalue()).decode()}
        return dict(digit_trajectory(row))


def lora_config():
    from peft import LoraConfig

    from twinkle.model.vision import VISION_MODULES

    return LoraConfig(
        r=8, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", exclude_modules=VISION_MODULES
    )


def rss_mib() -> float | None:
    """The process's resident memory now (Linux ``/proc``; None elsewhere)."""
    statm = Path("/proc/self/statm")
    if not statm.exists():
        return None
    return int(statm.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def twinkle_side(opts: argparse.Namespace, work: Path) -> dict:
    import torch

    import twinkle
    from twinkle.dataloader import DataLoader
    from twinkle.dataset import DatasetMeta, LazyDataset
    from twinkle.dataset.digits import digits_file
    from twinkle.kernel import kernelize
    from twinkle.model import TransformersModel
    from twinkle.runtime import RunDefaults

    twinkle.initialize(seed=opts.seed, run=RunDefaults(output_dir=str(work), report_to=()))
    dataset = LazyDataset(DatasetMeta(str(digits_file("train"))))
    dataset.set_template("Qwen2_5VLTemplate", model_id=opts.model_id, max_length=opts.max_length)
    dataset.map(PictureRow(opts.image_size))
    dataset.encode()
    unloaded = rss_mib()
    model = kernelize(TransformersModel(model_id=opts.model_id, model_cls=MODEL_CLS, dtype=torch.float32))
    torch.manual_seed(opts.seed)  # the same LoRA initialisation as the Trainer side
    model.add_adapter_to_model("default", lora_config())
    model.set_optimizer("AdamW", lr=opts.lr, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    steps: list[dict] = []
    before = rss_mib()
    last = time.perf_counter()
    while len(steps) < opts.steps:  # passes over the rows, in order, until --steps
        for batch in DataLoader(dataset=dataset, batch_size=opts.batch_size):
            loss = model.forward_backward(inputs=batch)
            model.clip_grad_and_step(max_grad_norm=1.0)
            now = time.perf_counter()
            steps.append(
                {"loss": float(loss), "s": now - last, "images": sum(len(r["image_grid_thw"]) for r in batch)}
            )
            last = now
            if len(steps) == opts.steps:
                break
    return {"steps": steps, "rss_before_steps_mib": before, "rss_before_model_mib": unloaded}


class EncodedRows:
    """The Trainer side's dataset: each bundled row encoded by the template when it is read."""

    def __init__(self, template, rows: list[dict], to_messages: PictureRow):
        self.template, self.rows, self.to_messages = template, rows, to_messages

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return self.template.encode(self.to_messages(self.rows[index]), index=index)


def collate(rows: list[dict], pad_id: int, image_token_id: int) -> dict:
    """Right-padded ids, mask and labels, the rows' patches and grids joined, and the token types."""
    import torch

    width = max(len(r["input_ids"]) for r in rows)

    def padded(key: str, fill: int):
        return torch.tensor([list(r[key]) + [fill] * (width - len(r[key])) for r in rows])

    input_ids = padded("input_ids", pad_id)
    return {
        "input_ids": input_ids,
        "attention_mask": torch.tensor([[1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"])) for r in rows]),
        "labels": padded("labels", -100),
        "pixel_values": torch.cat([torch.as_tensor(r["pixel_values"]) for r in rows]),
        "image_grid_thw": torch.cat([torch.as_tensor(r["image_grid_thw"]) for r in rows]),
        "mm_token_type_ids": (input_ids == image_token_id).to(torch.int32),
    }  # fmt: skip


def trainer_side(opts: argparse.Namespace, work: Path) -> dict:
    import torch
    import transformers
    from peft import get_peft_model
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from twinkle.dataset.digits import digits_file
    from twinkle.template import get_template

    template = get_template("Qwen2_5VLTemplate", opts.model_id, max_length=opts.max_length)
    rows = [json.loads(line) for line in digits_file("train").read_text().splitlines() if line.strip()]
    unloaded = rss_mib()
    model = getattr(transformers, MODEL_CLS).from_pretrained(opts.model_id, dtype=torch.float32)
    torch.manual_seed(opts.seed)
    model = get_peft_model(model, lora_config())
    pad_id = template.tokenizer.pad_token_id
    steps: list[dict] = []
    before: list[float | None] = []

    class Timer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            before.append(rss_mib())

        def on_step_begin(self, args, state, control, **kwargs):
            if not steps:  # the first step starts here; later ones where the one before ended
                self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            steps.append({"s": now - self.last, "images": opts.batch_size})
            self.last = now

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs and steps:
                steps[-1]["loss"] = float(logs["loss"])

    args = TrainingArguments(
        output_dir=str(work), per_device_train_batch_size=opts.batch_size, max_steps=opts.steps,
        learning_rate=opts.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
        activation_checkpointing=False, bf16=False, fp16=False, use_cpu=True,
        train_sampling_strategy="sequential", remove_unused_columns=False, dataloader_num_workers=0,
        seed=opts.seed, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(
        model=model, args=args, train_dataset=EncodedRows(template, rows, PictureRow(opts.image_size)),
        data_collator=lambda batch: collate(batch, pad_id, template.image_token_id), callbacks=[Timer()],
    )  # fmt: skip
    for quiet in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(quiet)
    trainer.train()
    return {"steps": steps, "rss_before_steps_mib": before[0], "rss_before_model_mib": unloaded}


def run_side(opts: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(opts.threads)
    torch.manual_seed(opts.seed)
    with tempfile.TemporaryDirectory() as work:
        result = (twinkle_side if opts.side == "twinkle" else trainer_side)(opts, Path(work))
    result["peak_rss_mib"] = peak_rss_mib()
    Path(opts.result).write_text(json.dumps(result))


def launch(opts: argparse.Namespace, side: str, folder: Path) -> dict:
    out = folder / f"{side}.json"
    argv = [sys.executable, str(HERE), "--side", side, "--result", str(out)]
    for key in (
        "model_id",
        "steps",
        "warmup",
        "batch_size",
        "image_size",
        "max_length",
        "lr",
        "threads",
        "seed",
    ):
        argv += [f"--{key.replace('_', '-')}", str(getattr(opts, key))]
    env = {**os.environ, "OMP_NUM_THREADS": str(opts.threads)}
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"error: the {side} side failed:\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def summary(result: dict, opts: argparse.Namespace) -> dict:
    timed = result["steps"][opts.warmup :]
    return {
        "samples_per_s": opts.batch_size / statistics.median(s["s"] for s in timed),
        "peak_rss_mib": result["peak_rss_mib"],
        "steps_rss_mib": None
        if result["rss_before_steps_mib"] is None
        else result["peak_rss_mib"] - result["rss_before_steps_mib"],
        "before_model_rss_mib": result["rss_before_model_mib"],
        "losses": [s.get("loss") for s in result["steps"]],
    }


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def report(opts: argparse.Namespace, rounds: list[dict]) -> str:
    import torch
    import transformers

    tw = [r["twinkle"] for r in rounds]
    hf = [r["hf_trainer"] for r in rounds]
    speed = statistics.median(a["samples_per_s"] / b["samples_per_s"] for a, b in zip(tw, hf, strict=True))
    memory = statistics.median(a["peak_rss_mib"] / b["peak_rss_mib"] for a, b in zip(tw, hf, strict=True))

    def shown(losses):
        return [round(x, 4) if x is not None else None for x in losses]

    lines = [
        f"# VL LoRA SFT: Twinkle vs HF Trainer + PEFT ({datetime.date.today()})",
        "",
        f"CPU: {cpu_name()} ({os.cpu_count()} cores), {opts.threads} threads; torch {torch.__version__}, "
        f"transformers {transformers.__version__}; model {opts.model_id} fp32; {opts.steps} steps of "
        f"{opts.batch_size} pictures of {opts.image_size}x{opts.image_size} (first {opts.warmup} untimed), "
        f"AdamW lr {opts.lr} constant, LoRA r 8 alpha 32 on the language model's linear layers, "
        f"dropout 0; {len(rounds)} round(s), medians.",
        "",
        "| | Twinkle | HF Trainer | ratio | target |",
        "|---|---|---|---|---|",
        f"| samples/s | {statistics.median(a['samples_per_s'] for a in tw):.3f} | "
        f"{statistics.median(b['samples_per_s'] for b in hf):.3f} | {speed:.2f}x | >= 2x |",
        f"| peak RSS (MiB) | {statistics.median(a['peak_rss_mib'] for a in tw):.0f} | "
        f"{statistics.median(b['peak_rss_mib'] for b in hf):.0f} | {memory:.2f}x | <= 0.6x |",
    ]
    if all(r["before_model_rss_mib"] is not None for r in tw + hf):
        lines.append(
            f"| resident before the model loads (MiB) | {statistics.median(a['before_model_rss_mib'] for a in tw):.0f} | "
            f"{statistics.median(b['before_model_rss_mib'] for b in hf):.0f} | | |"
        )
    if all(r["steps_rss_mib"] is not None for r in tw + hf):
        lines.append(
            f"| peak RSS above the loaded model (MiB) | {statistics.median(a['steps_rss_mib'] for a in tw):.0f} | "
            f"{statistics.median(b['steps_rss_mib'] for b in hf):.0f} | | |"
        )
    lines += [
        "",
        "Losses per step (round 1):",
        "",
        f"- Twinkle: {shown(tw[0]['losses'])}",
        f"- HF Trainer: {shown(hf[0]['losses'])}",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    opts = parse()
    if opts.side:
        run_side(opts)
        return
    if opts.model_id is None:  # made once, before either side starts, so neither pays for it
        sys.path.insert(0, str(HERE.parents[1] / "cookbook" / "mm"))
        from vl_checkpoint import vl_checkpoint

        opts.model_id = vl_checkpoint(seed=0)
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
