"""Side A, "twinkle": the contract script's pipeline and loop, timed step by step.

Run by ``bench/run.py`` as ``python bench/twinkle_side.py SPEC.json OUT.json``. The optimizer,
schedule and LoRA dropout are the spec's config (``common.CONFIGS``), the same on the Trainer
side: by default the contract's (Muon, cosine after 5 warm-up steps, dropout 0.05)."""

import time

import torch
from common import (
    batch_record,
    build_dataset,
    log_step,
    lora_config,
    optimizer_kwargs,
    samples_digest,
    set_up_process,
    side_args,
    sync,
    write_result,
)
from flops import model_shape

import twinkle
from twinkle.dataloader import DataLoader
from twinkle.kernel import kernelize
from twinkle.model import TransformersModel
from twinkle.model.packing import pack
from twinkle.processor import collate

SIDE = "twinkle"


def count_packed(record, batch) -> None:
    """What the packed row really runs: its length through the layers, and per-sample causal
    pairs plus each sample's pairs with the shared prefix (``twinkle.model.packing``)."""
    packed = pack(batch)
    if packed is None:
        return
    layout = packed["twinkle_segments"]
    p = layout.prefix
    record.body_positions = layout.length
    record.attention_pairs = p * (p + 1) // 2 + sum(
        (e - s) * p + (e - s) * (e - s + 1) // 2 for s, e in layout.spans
    )


def main() -> None:
    spec, out = side_args()
    set_up_process(spec)
    twinkle.initialize(seed=spec.seed)

    dataset = build_dataset(spec)
    digest = samples_digest([dataset[i] for i in range(len(dataset))])
    dataloader = DataLoader(dataset=dataset, batch_size=spec.batch_size)
    # as the cookbook does (its default dtype is bf16 on CUDA, fp32 on CPU, which --dtype auto picks)
    model = kernelize(TransformersModel(model_id=spec.model_path, dtype=spec.torch_dtype))
    torch.manual_seed(spec.seed)  # the same LoRA initialisation as the Trainer side
    model.add_adapter_to_model("default", lora_config(spec.train.lora_dropout))
    optimizer_cls, kwargs = optimizer_kwargs(spec.train)
    model.set_optimizer(optimizer_cls, **kwargs)
    if spec.train.warmup_steps is not None:
        model.set_lr_scheduler(
            "CosineWarmupScheduler",
            num_warmup_steps=spec.train.warmup_steps,
            num_training_steps=spec.total_steps,
        )
    # As the cookbook runs with --enable-liger: the chunked linear cross-entropy (our own on CPU),
    # so no (batch, seq, vocab) logits tensor exists; the head runs on supervised positions only.
    model.set_loss("FusedLinearCrossEntropyLoss")

    records = []
    for index, batch in enumerate(dataloader):
        if index == spec.total_steps:
            break
        # the loader yields rows, which the model collates inside its step (timed, as in the
        # contract); the counts come from the same collation done here, outside the timing
        padded = collate(batch, dataset.pad_token_id)
        record = batch_record(
            padded["input_ids"], padded["labels"], padded["attention_mask"], head_positions="supervised"
        )
        count_packed(record, padded)
        record.begin = time.perf_counter()
        record.loss = model.forward_backward(inputs=batch, task="fused_lm_ce")
        model.clip_grad_and_step(max_grad_norm=spec.max_grad_norm)
        sync()
        record.end = time.perf_counter()
        records.append(record)
        log_step(SIDE, index, spec, record)

    if len(records) != spec.total_steps:
        raise SystemExit(f"[{SIDE}] the data gave {len(records)} steps, expected {spec.total_steps}")
    write_result(out, SIDE, spec, records, model_shape(model.model), digest)


if __name__ == "__main__":
    main()
