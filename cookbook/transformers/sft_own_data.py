"""Fine-tune with LoRA on your own chat data: a JSONL of ``messages`` rows (OpenAI / ShareGPT style)
or of Alpaca rows (``instruction``, ``input``, ``output``).

    python cookbook/transformers/sft_own_data.py --dataset-id my_chats.jsonl --output-dir output/mine
    python cookbook/transformers/sft_own_data.py --dataset-id alpaca.jsonl --data-format alpaca
    torchrun --nproc_per_node 2 cookbook/transformers/sft_own_data.py --dataset-id my_chats.jsonl --fsdp-size 2

Every flag of ``--help`` applies (model, LoRA, optimizer, schedule, batch, max length, resume).
``--eval-samples N`` holds the first N rows out for evaluation (default: none); the rest train.
``--max-steps N`` ends the run after N optimizer steps (the schedule ends there too);
``--save-steps N`` saves ``checkpoint-<step>`` every N optimizer steps; ``--max-grad-norm`` bounds
each step's gradient norm.
"""

from peft import LoraConfig

import twinkle
from twinkle import DeviceMesh, get_device_placement, get_logger
from twinkle.cli import CLI
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.kernel import kernelize
from twinkle.model import TransformersModel
from twinkle.preprocessor import AlpacaProcessor, MessagesProcessor

PROCESSORS = {"messages": MessagesProcessor, "alpaca": AlpacaProcessor}

logger = get_logger()
args = CLI.from_args()
twinkle.initialize(
    mode=args.infra.mode,
    global_device_mesh=DeviceMesh.from_sizes(fsdp_size=args.infra.fsdp_size, dp_size=args.infra.dp_size),
)


def build_dataset(rows: range | None) -> Dataset:
    data_format = args.extra.get("data_format", "messages")
    if data_format not in PROCESSORS:
        raise SystemExit(f"error: --data-format {data_format!r} is not one of {', '.join(PROCESSORS)}")
    dataset = Dataset(DatasetMeta(args.dataset.dataset_id, subset_name=args.dataset.subset_name,
                                  split=args.dataset.split, data_slice=rows))  # fmt: skip
    dataset.set_template(args.template.template_cls, model_id=args.model.model_id,
                         max_length=args.template.max_length,
                         truncation_strategy=args.template.truncation_strategy)  # fmt: skip
    dataset.map(PROCESSORS[data_format]())
    dataset.encode()
    return dataset


def main() -> None:
    held_out = args.training.eval_samples or 0
    total = len(Dataset(DatasetMeta(args.dataset.dataset_id, subset_name=args.dataset.subset_name,
                                    split=args.dataset.split)))  # fmt: skip
    if held_out >= total:
        raise SystemExit(f"error: --eval-samples {held_out} leaves no row of {total} to train on")
    train_rows = range(held_out, min(total, held_out + (args.training.train_samples or total)))
    train = DataLoader(dataset=build_dataset(train_rows), batch_size=args.training.batch_size)
    evaluation = build_dataset(range(held_out)) if held_out else None

    model = kernelize(TransformersModel(model_id=args.model.model_id))
    model.add_adapter_to_model(args.lora.adapter_name, LoraConfig(**args.get_lora_args()),
                               gradient_accumulation_steps=args.training.gradient_accumulation_steps)  # fmt: skip
    model.set_optimizer(args.optimizer.optimizer_cls, lr=args.optimizer.learning_rate)
    max_steps, save_steps = args.training.max_steps, args.training.save_steps
    # The horizon counts micro-batches: with --max-steps the schedule ends at the last step taken.
    horizon = len(train)
    if max_steps is not None:
        horizon = min(horizon, max_steps * args.training.gradient_accumulation_steps)
    model.set_lr_scheduler(args.scheduler.scheduler_cls, num_warmup_steps=args.scheduler.num_warmup_steps,
                           num_training_steps=horizon)  # fmt: skip
    if args.training.resume_from_checkpoint:
        progress = model.resume_from_checkpoint(args.training.resume_from_checkpoint)
        train.resume_from_checkpoint(progress["consumed_train_samples"])
    logger.info(get_device_placement())
    logger.info(model.get_train_configs())

    def save(name: str) -> None:
        model.save(name, output_dir=args.training.output_dir,
                   consumed_train_samples=train.get_state()["consumed_train_samples"])  # fmt: skip

    group = model.optimizer_group[args.lora.adapter_name]
    done = max_steps is not None and group.optimizer_steps >= max_steps  # a resumed run may be done
    for batch in [] if done else train:
        updates = group.optimizer_steps
        model.forward_backward(inputs=batch, task="fused_lm_ce")
        model.clip_grad_and_step(max_grad_norm=args.optimizer.max_grad_norm)
        step, stepped = group.cur_step, group.optimizer_steps > updates
        if step % args.training.log_interval == 0:
            logger.info(f"step {step} of {horizon}: {model.calculate_metric(is_training=True)}")
        evaluate = evaluation is not None and step % (args.training.eval_interval or 50) == 0
        if evaluate:
            for eval_batch in DataLoader(dataset=evaluation, batch_size=args.training.batch_size):
                model.forward_only(inputs=eval_batch, task="fused_lm_ce")
                model.calculate_loss()
            logger.info(f"eval at step {step}: {model.calculate_metric(is_training=False)}")
        if evaluate or (save_steps is not None and stepped and group.optimizer_steps % save_steps == 0):
            save(f"checkpoint-{step}")
        if max_steps is not None and group.optimizer_steps >= max_steps:
            logger.info(f"--max-steps {max_steps}: stopping after optimizer step {group.optimizer_steps}")
            break
    save("last-checkpoint")


if __name__ == "__main__":
    main()
