"""Fine-tune a vision-language model on images with LoRA: the bundled digits and shapes (32x32
pictures, 22 answers: a digit, or a colour and a shape), read lazily, one image per question.

    python cookbook/mm/fsdp2.py
    torchrun --nproc_per_node 2 cookbook/mm/fsdp2.py --fsdp-size 2
    python cookbook/mm/fsdp2.py --model-id PATH/TO/Qwen2.5-VL-3B-Instruct --lr 1e-4 --max-steps 200

Its defaults are in ``fsdp2.yaml`` (8 pictures a step, 400 steps, evaluation every 100).
With no ``--model-id`` it trains a small Qwen2.5-VL made at first use into the Twinkle cache
(``vl_checkpoint.py``): the bundled SmolLM2-135M-Instruct as the language model and a small
random vision tower. LoRA (``--target-modules all-linear``, the default) lands on the language
model only; ``--train-vision true`` (the default without ``--model-id``, whose tower starts random)
trains the whole vision tower and its projector as well (PEFT's ``modules_to_save``).

It logs the training loss as it falls and, at each evaluation, the held-out loss and answer
accuracy on the bundled held-out split: the share of pictures whose whole answer the model gives
with every token above probability 1/2 (so greedy decoding answers exactly that), against
chance (1 in 22)."""

import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from peft import LoraConfig

import twinkle
from twinkle import DeviceMesh, get_device_placement, get_logger
from twinkle.cli import CLI
from twinkle.dataloader import DataLoader, collate
from twinkle.dataset import DatasetMeta, LazyDataset
from twinkle.dataset.digits import digit_trajectory, digits_file
from twinkle.model import TransformersModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vl_checkpoint import vl_checkpoint  # noqa: E402  (beside this script)

CHANCE = 1 / 22

logger = get_logger()
args = CLI.from_args(config_file=Path(__file__).with_name("fsdp2.yaml"))  # the defaults it ships
device_mesh = DeviceMesh.from_sizes(fsdp_size=args.infra.fsdp_size, dp_size=args.infra.dp_size)
twinkle.initialize(mode=args.infra.mode, global_device_mesh=device_mesh)


def image_dataset(split: str, model_id: str, samples: int | None) -> LazyDataset:
    """The bundled split as conversations (``Message(images=[png])``), encoded when read."""
    meta = DatasetMeta(str(digits_file(split)), data_slice=range(samples) if samples else None)
    dataset = LazyDataset(dataset_meta=meta)
    dataset.set_template("Qwen2_5VLTemplate", model_id=model_id, max_length=args.template.max_length)
    dataset.map(digit_trajectory)
    dataset.encode()
    return dataset


def right_answers(rows: list[dict], logps: torch.Tensor) -> int:
    """How many rows the model answers right for sure: every reply token (the end of turn
    included) has probability above 1/2 given the picture, the question and the answer so far,
    so it is the greedy choice and greedy decoding answers exactly that (a lower bound on the
    greedy answer's accuracy, from the log-probabilities ``forward_only`` returns)."""
    labels = collate(rows, 0)["labels"]
    sure = (logps > math.log(0.5)) | (labels == -100)
    return int(sure.all(-1).sum())


def evaluate(model: TransformersModel, dataset: LazyDataset) -> dict:
    right, total = 0, 0
    for batch in DataLoader(dataset=dataset, batch_size=args.training.batch_size):
        out = model.forward_only(inputs=batch)  # the held-out loss (calculate_metric below)
        model.calculate_loss()
        right, total = right + right_answers(batch, out["logps"]), total + len(batch)
    if dist.is_initialized():  # every rank scored its share of the rows
        both = torch.tensor([right, total])
        dist.all_reduce(both)
        right, total = both.tolist()
    metrics = model.calculate_metric(is_training=False)
    metrics["answer_accuracy"] = right / max(1, total)
    return metrics


def train() -> None:
    model_id = args.model.model_id or vl_checkpoint(seed=args.infra.seed)
    # the made checkpoint's tower is random: it has to learn (--train-vision true|false)
    train_vision = str(args.extra.get("train_vision", args.model.model_id is None)).lower() == "true"
    dataset = image_dataset("train", model_id, args.training.train_samples)
    held_out = image_dataset("eval", model_id, args.training.eval_samples)
    dataloader = DataLoader(
        dataset=dataset, batch_size=args.training.batch_size, shuffle=True, seed=args.infra.seed
    )

    model = TransformersModel(model_id=model_id, model_cls="Qwen2_5_VLForConditionalGeneration")
    lora = LoraConfig(
        r=args.lora.lora_r,
        lora_alpha=args.lora.lora_alpha,
        lora_dropout=args.lora.lora_dropout,
        target_modules=args.lora.target_modules,  # all-linear: the language model's linear layers
        modules_to_save=["visual"] if train_vision else None,  # Qwen2.5-VL's tower and projector
    )
    model.add_adapter_to_model(
        args.lora.adapter_name, lora, gradient_accumulation_steps=args.training.gradient_accumulation_steps
    )
    model.set_template("Qwen2_5VLTemplate", model_id=model_id)
    model.set_optimizer(optimizer_cls=args.optimizer.optimizer_cls, lr=args.optimizer.learning_rate)
    max_steps = args.training.max_steps
    model.set_lr_scheduler(
        scheduler_cls=args.scheduler.scheduler_cls,
        num_warmup_steps=args.scheduler.num_warmup_steps,
        num_training_steps=max_steps,
    )
    logger.info(get_device_placement())
    logger.info(model.get_train_configs())
    eval_interval = args.training.eval_interval

    metrics = evaluate(model, held_out)
    logger.info(
        f"before training: held-out loss {metrics['loss']:.3f}, answer accuracy "
        f"{metrics['answer_accuracy']:.3f} (chance {CHANCE:.3f})"
    )
    step = 0
    while step < max_steps:
        for batch in dataloader:
            model.forward_backward(inputs=batch)
            model.clip_grad_and_step(max_grad_norm=args.optimizer.max_grad_norm)
            step += 1
            if step % args.training.log_interval == 0:
                metric = model.calculate_metric(is_training=True)
                logger.info(f"step {step}/{max_steps}: loss {metric['loss']:.3f}, lr {metric['lr']:.2e}")
            if step % eval_interval == 0 or step == max_steps:
                metrics = evaluate(model, held_out)
                logger.info(
                    f"step {step}: held-out loss {metrics['loss']:.3f}, answer accuracy "
                    f"{metrics['answer_accuracy']:.3f} (chance {CHANCE:.3f})"
                )
            if step == max_steps:
                break
    model.save("last-checkpoint", output_dir=args.training.output_dir)


if __name__ == "__main__":
    train()
