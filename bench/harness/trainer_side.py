"""Side B, "hf_trainer": the usual route, Hugging Face ``Trainer`` with a PEFT LoRA adapter.

Run by ``bench/run.py`` as ``python bench/trainer_side.py SPEC.json OUT.json``. Configured as a
careful user would: the same weights and LoRA config, the Twinkle-encoded samples in the same
order (``train_sampling_strategy='sequential'``), its default collator for this data
(``DataCollatorForSeq2Seq``), gradient clipping at 1.0, no gradient checkpointing; fp32 on CPU,
bf16 on CUDA with Liger kernels when ``liger_kernel`` is installed. The optimizer follows the
spec's config: for the contract's, the same ``torch.optim.Muon`` and the same schedule (Twinkle's
``CosineWarmupScheduler``, a ``LambdaLR``) handed to the Trainer; for ``adamw``, its default
optimizer (fused AdamW, weight decay 0) at a constant learning rate."""

import importlib.util
import tempfile
import time

import torch
from common import (
    StepRecord,
    batch_record,
    log_step,
    lora_config,
    optimizer_kwargs,
    read_encoded,
    samples_digest,
    set_up_process,
    side_args,
    sync,
    use_cuda,
    write_result,
)
from flops import model_shape
from peft import get_peft_model
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from twinkle.hub import resolve_model

SIDE = "hf_trainer"


class SampleList(torch.utils.data.Dataset):
    def __init__(self, samples: list[dict[str, list[int]]]):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        sample = self.samples[index]
        return {**sample, "attention_mask": [1] * len(sample["input_ids"])}


class CountingCollator:
    """The default collator, noting each batch's counts (the Trainer computes logits everywhere)."""

    def __init__(self, collator: DataCollatorForSeq2Seq):
        self.collator = collator
        self.records: list[StepRecord] = []

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        batch = self.collator(features)
        self.records.append(
            batch_record(batch["input_ids"], batch["labels"], batch["attention_mask"], head_positions="all")
        )
        return batch


class StepTimer(TrainerCallback):
    """Timestamps every optimizer step and takes its loss from the per-step log."""

    def __init__(self, spec, collator: CountingCollator):
        self.spec = spec
        self.collator = collator
        self.begins: list[float] = []
        self.ends: list[float] = []
        self.losses: list[float] = []

    def on_train_begin(self, args, state, control, **kwargs):
        torch.set_num_threads(self.spec.threads)  # in case a library changed it while setting up

    def on_step_begin(self, args, state, control, **kwargs):
        self.begins.append(time.perf_counter())

    def on_step_end(self, args, state, control, **kwargs):
        sync()
        self.ends.append(time.perf_counter())

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))
            index = len(self.losses) - 1
            log_step(SIDE, index, self.spec, self.record(index))

    def record(self, index: int) -> StepRecord:
        record = self.collator.records[index]
        record.begin, record.end, record.loss = self.begins[index], self.ends[index], self.losses[index]
        return record


def main() -> None:
    spec, out = side_args()
    set_up_process(spec)
    cuda = use_cuda()
    dtype = spec.torch_dtype

    samples = read_encoded(spec.encoded_path)
    path = str(resolve_model(spec.model_path))
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "right"  # as Twinkle pads; position ids then match
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    torch.manual_seed(spec.seed)  # the same LoRA initialisation as the Twinkle side
    model = get_peft_model(model, lora_config(spec.train.lora_dropout))
    optimizers = (None, None)  # the Trainer's own
    if spec.train.optimizer != "AdamW" or spec.train.warmup_steps is not None:
        from twinkle.optim.scheduler import CosineWarmupScheduler

        optimizer_cls, kwargs = optimizer_kwargs(spec.train)
        optimizer = optimizer_cls([p for p in model.parameters() if p.requires_grad], **kwargs)
        if spec.train.warmup_steps is None:
            schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        else:
            schedule = CosineWarmupScheduler(optimizer, spec.train.warmup_steps, spec.total_steps)
        optimizers = (optimizer, schedule)

    collator = CountingCollator(DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100))
    timer = StepTimer(spec, collator)
    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=spec.batch_size,
            max_steps=spec.total_steps,
            learning_rate=spec.train.lr,
            lr_scheduler_type="constant",
            weight_decay=0.0,
            max_grad_norm=spec.max_grad_norm,
            activation_checkpointing=False,
            train_sampling_strategy="sequential",
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            dataloader_num_workers=0,
            disable_tqdm=True,
            seed=spec.seed,
            use_cpu=not cuda,
            bf16=dtype == torch.bfloat16,  # autocast; on the CPU too when --dtype bfloat16
            use_liger_kernel=cuda and importlib.util.find_spec("liger_kernel") is not None,
        )
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=SampleList(samples),
            data_collator=collator,
            processing_class=tokenizer,
            callbacks=[timer],
            optimizers=optimizers,
        )
        for quiet in (PrinterCallback, ProgressCallback):  # one line a step comes from StepTimer
            trainer.remove_callback(quiet)
        trainer.train()

    records = [timer.record(i) for i in range(len(timer.losses))]
    if len(records) != spec.total_steps:
        raise SystemExit(f"[{SIDE}] logged {len(records)} steps, expected {spec.total_steps}")
    optim = (
        type(optimizers[0]).__name__
        if optimizers[0] is not None
        else getattr(args.optim, "value", str(args.optim))
    )
    extra = {"liger_kernel": args.use_liger_kernel, "optim": optim}
    write_result(out, SIDE, spec, records, model_shape(model), samples_digest(samples), extra)


if __name__ == "__main__":
    main()
