"""Train the tiny model in a fresh process, for the resume test in ``test_checkpoint.py``.

    python resume_run.py first  MODEL_DIR WORK_DIR GA:N [GA:N ...]
    python resume_run.py resume MODEL_DIR WORK_DIR GA:N [GA:N ...]

A case ``GA:N`` is one pass over 2N micro-batches with gradient_accumulation_steps GA and LoRA
dropout (so the RNG state matters). ``first`` trains the 2N micro-batches uninterrupted (run
"full"), then starts over, trains N and saves ``WORK_DIR/GA-N/ckpt`` (run "first"). ``resume``,
a new process, loads that checkpoint and trains the remaining N (run "resume"). Runs that reach
the end save ``WORK_DIR/GA-N/<run>-end``. The last stdout line is JSON:
``{case: {run: [mean token loss of each micro-batch], "progress": resume's return value}}``."""

import json
import sys
from pathlib import Path

from peft import LoraConfig

import twinkle
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.model import TransformersModel
from twinkle.preprocessor import SelfCognitionProcessor

BATCH_SIZE = 2
SEED = 1234


def build_dataset(model_dir: str, rows: int) -> Dataset:
    dataset = Dataset(DatasetMeta(None, data_slice=range(rows)))
    dataset.set_template("Template", model_id=model_dir, max_length=128)
    dataset.map(SelfCognitionProcessor("Twinkle", "Acme"))
    dataset.encode()
    return dataset


def train(model_dir, dataset, accumulation, case_dir, run, stop_after=None, resume_from=None):
    twinkle.initialize(seed=SEED)  # every run starts from the RNG state a new process starts from
    dataloader = DataLoader(dataset, batch_size=BATCH_SIZE)
    model = TransformersModel(model_dir)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.1)
    model.add_adapter_to_model("default", lora, gradient_accumulation_steps=accumulation)
    model.set_optimizer("AdamW", lr=1e-2)
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=1, num_training_steps=len(dataloader))
    progress = None
    if resume_from is not None:
        progress = model.resume_from_checkpoint(
            str(resume_from), resume_only_model=False, adapter_name="default"
        )
        dataloader.resume_from_checkpoint(progress["consumed_train_samples"])

    def save(name):
        consumed = dataloader.get_state()["consumed_train_samples"]
        model.save(name, output_dir=str(case_dir), adapter_name="default", consumed_train_samples=consumed)

    losses = []
    for batch in dataloader:
        losses.append(model.forward_backward(inputs=batch))
        model.clip_grad_and_step()
        if len(losses) == stop_after:
            save("ckpt")
            return losses, progress
    save(f"{run}-end")
    return losses, progress


def main(phase: str, model_dir: str, work_dir: str, cases: list[str]) -> None:
    results = {}
    for case in cases:
        accumulation, n = (int(x) for x in case.split(":"))
        case_dir = Path(work_dir) / f"{accumulation}-{n}"
        dataset = build_dataset(model_dir, 2 * n * BATCH_SIZE)
        if phase == "first":
            full, _ = train(model_dir, dataset, accumulation, case_dir, "full")
            first, _ = train(model_dir, dataset, accumulation, case_dir, "first", stop_after=n)
            results[case] = {"full": full, "first": first}
        else:
            resumed, progress = train(
                model_dir, dataset, accumulation, case_dir, "resume", resume_from=case_dir / "ckpt"
            )
            results[case] = {"resume": resumed, "progress": progress}
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
