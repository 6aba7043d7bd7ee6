"""Two identities trained at once on one copy of a base model.

One ``MultiLoraTransformersModel`` holds a LoRA adapter per identity, each with its own rank,
optimizer, schedule, data and checkpoints. The identities' batches alternate (one forward and
backward at a time, on the adapter the batch belongs to), and each adapter ends as a plain PEFT
adapter folder, ``<output_dir>/<adapter>/last-checkpoint``:

    python cookbook/transformers/multi_lora.py
    twinkle chat --adapter output/twinkle/last-checkpoint --prompt "Who are you?"
    twinkle chat --adapter output/pip/last-checkpoint --prompt "Who are you?"

The identities come from comma-separated lists, one entry per adapter (``args.extra``):
``--adapters twinkle,pip --model-names Twinkle,Pip --model-authors "ModelScope,Acme Labs"
--ranks 8,16 --optimizers Muon,AdamW`` (these replace the contract's ``--lora-rank``,
``--model-name`` and ``--model-author``). Every other option is the contract's
(``cookbook/transformers/fsdp2.py``): ``--lr``, ``--batch-size``, ``--train-samples``, ...

Each adapter also saves ``checkpoint-<step>`` at every evaluation. ``--resume-from-checkpoint
auto`` continues every adapter from the newest complete checkpoint in its own folder."""

import os
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path

from peft import LoraConfig

import twinkle
from twinkle import DeviceMesh, get_logger
from twinkle.cli import CLI
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.kernel import kernelize
from twinkle.model import MultiLoraTransformersModel
from twinkle.preprocessor import SelfCognitionProcessor
from twinkle.utils.errors import UserError

logger = get_logger()
args = CLI.from_args()

device_mesh = DeviceMesh.from_sizes(fsdp_size=args.infra.fsdp_size, dp_size=args.infra.dp_size)
twinkle.initialize(mode=args.infra.mode, global_device_mesh=device_mesh)

# One entry per identity; the flag of each list is its key with '-' for '_'.
DEFAULTS = {
    "adapters": "twinkle,pip",
    "model_names": "Twinkle,Pip",
    "model_authors": "ModelScope,Acme Labs",
    "ranks": "8,16",
    "optimizers": "Muon,AdamW",
}
RESERVED = ("tensorboard", "wandb", "swanlab")  # the run's own folders in --output-dir


@dataclass
class Identity:
    adapter: str
    name: str
    author: str
    rank: int
    optimizer: str


def _entries(key: str) -> list[str]:
    """The comma-separated list of ``--<key>`` (a YAML list is taken as it is)."""
    value = args.extra.get(key, DEFAULTS[key])
    items = value if isinstance(value, list | tuple) else str(value).split(",")
    return [str(item).strip() for item in items]


def read_identities() -> list[Identity]:
    """The identities of the command line; a list of the wrong length, an empty or repeated
    adapter name, a rank below 1 or an unknown optimizer is a ``UserError``."""
    from twinkle.optim.optimizer import resolve_optimizer_cls

    lists = {key: _entries(key) for key in DEFAULTS}
    adapters = lists["adapters"]
    for key, values in lists.items():
        if len(values) != len(adapters) or "" in values:
            flag = key.replace("_", "-")
            raise UserError(
                f"--{flag} {','.join(values)}: give one non-empty entry per adapter "
                f"(--adapters {','.join(adapters)}), comma-separated"
            )
    for adapter in adapters:
        if adapters.count(adapter) > 1:
            raise UserError(f"--adapters names {adapter!r} twice; give each identity its own adapter name")
        if adapter in RESERVED:
            raise UserError(
                f"--adapters {adapter!r}: {', '.join(RESERVED)} are the run's metric folders in "
                "--output-dir; pick another adapter name"
            )
    ranks = []
    for rank in lists["ranks"]:
        if not rank.isdigit() or int(rank) < 1:
            raise UserError(f"--ranks {','.join(lists['ranks'])}: each LoRA rank must be an integer >= 1")
        ranks.append(int(rank))
    for optimizer in lists["optimizers"]:
        resolve_optimizer_cls(optimizer, "--optimizers")
    rows = zip(
        adapters, lists["model_names"], lists["model_authors"], ranks, lists["optimizers"], strict=True
    )
    return [Identity(*row) for row in rows]


def build_dataset(identity: Identity, num_samples: int) -> Dataset:
    """The self-cognition rows with this identity's name and author."""
    dataset = Dataset(dataset_meta=DatasetMeta(args.dataset.dataset_id, data_slice=range(num_samples)))
    dataset.set_template(
        args.template.template_cls,
        model_id=args.model.model_id,
        max_length=args.template.max_length,
        truncation_strategy=args.template.truncation_strategy,
    )
    dataset.map(SelfCognitionProcessor(identity.name, identity.author))
    dataset.encode()
    return dataset


def add_identity(model: MultiLoraTransformersModel, identity: Identity, num_training_steps: int) -> None:
    """The identity's adapter, its optimizer (Muon rescaled to AdamW's learning rate, as in the
    contract, or the optimizer named), its schedule and, with --enable-liger, the fused loss."""
    config = LoraConfig(**{**args.get_lora_args(), "r": identity.rank})
    model.add_adapter_to_model(
        identity.adapter, config, gradient_accumulation_steps=args.training.gradient_accumulation_steps
    )
    extra = {"adjust_lr_fn": "match_rms_adamw"} if identity.optimizer == "Muon" else {}
    model.set_optimizer(
        identity.optimizer, lr=args.optimizer.learning_rate, adapter_name=identity.adapter, **extra
    )
    model.set_lr_scheduler(
        scheduler_cls=args.scheduler.scheduler_cls,
        num_warmup_steps=args.scheduler.num_warmup_steps,
        num_training_steps=num_training_steps,
        adapter_name=identity.adapter,
    )
    if args.model.enable_liger and args.model.enable_fused_ce:
        model.set_loss("LigerFusedLinearCrossEntropyLoss", adapter_name=identity.adapter, reduction="sum")


def evaluate(model: MultiLoraTransformersModel, identity: Identity) -> dict:
    eval_samples = args.training.eval_samples or 16
    dataset = build_dataset(identity, eval_samples)
    for batch in DataLoader(dataset=dataset, batch_size=args.training.batch_size):
        model.forward_only(inputs=batch, adapter_name=identity.adapter)
        model.calculate_loss()
    return model.calculate_metric(is_training=False, adapter_name=identity.adapter)


def adapter_dir(identity: Identity) -> Path:
    return Path(args.training.output_dir) / identity.adapter


def save(model: MultiLoraTransformersModel, identity: Identity, name: str, loader: DataLoader) -> None:
    model.save(
        name,
        output_dir=str(adapter_dir(identity)),
        adapter_name=identity.adapter,
        save_optimizer=True,
        consumed_train_samples=loader.get_state()["consumed_train_samples"],
    )


def resume(model: MultiLoraTransformersModel, identities: list[Identity], loaders: dict) -> None:
    """``--resume-from-checkpoint auto``: each adapter continues from the newest complete
    checkpoint in its own folder, ``<output-dir>/<adapter>`` (an adapter without one starts
    fresh); its data skips the samples that checkpoint consumed."""
    from twinkle.checkpoint import latest_checkpoint

    if args.resume_request is None:
        return
    if args.resume_request not in ("auto", "latest"):
        raise UserError(
            f"--resume-from-checkpoint {args.resume_request}: multi_lora.py keeps each adapter's "
            "checkpoints in <output-dir>/<adapter>; pass --resume-from-checkpoint auto to resume every adapter"
        )
    for identity in identities:
        found = latest_checkpoint(adapter_dir(identity))
        if found is None:
            logger.info(
                f"[{identity.adapter}] no complete checkpoint in {adapter_dir(identity)}; starting fresh"
            )
            continue
        progress = model.resume_from_checkpoint(
            str(found), resume_only_model=args.training.resume_only_model, adapter_name=identity.adapter
        )
        if not args.training.ignore_data_skip:
            loaders[identity.adapter].resume_from_checkpoint(progress["consumed_train_samples"])
        logger.info(f"[{identity.adapter}] resumed from {found}")


def train() -> None:
    identities = read_identities()
    train_samples = args.training.train_samples or 300  # the bundled rows once
    loaders = {
        i.adapter: DataLoader(dataset=build_dataset(i, train_samples), batch_size=args.training.batch_size)
        for i in identities
    }
    model = MultiLoraTransformersModel(
        model_id=args.model.model_id, max_loras=len(identities), max_r=max(i.rank for i in identities)
    )
    if os.environ.get("TWINKLE_TORCH_BASELINE", "").lower() not in ("1", "true", "yes"):
        model = kernelize(model)
    for identity in identities:
        add_identity(model, identity, num_training_steps=len(loaders[identity.adapter]))
        logger.info(model.get_train_configs(adapter_name=identity.adapter))
    resume(model, identities, loaders)
    task = "fused_lm_ce" if args.model.enable_liger and args.model.enable_fused_ce else "causal_lm"
    total = len(next(iter(loaders.values())))
    eval_interval = args.training.eval_interval or total
    # One batch of each identity in turn: the model switches adapters at every forward_backward.
    # (Adapters resumed from different steps each run their own remaining batches.)
    for batches in zip_longest(*loaders.values()):
        for identity, batch in zip(identities, batches, strict=True):
            if batch is None:
                continue
            model.forward_backward(inputs=batch, task=task, adapter_name=identity.adapter)
            model.clip_grad_and_step(adapter_name=identity.adapter)
            step = model.optimizer_group[identity.adapter].cur_step
            if step % args.training.log_interval == 0:
                metric = model.calculate_metric(is_training=True, adapter_name=identity.adapter)
                logger.info(f"[{identity.adapter}] step {step} of {total}, metric: {metric}")
            if step % eval_interval == 0:
                logger.info(f"[{identity.adapter}] eval at step {step}: {evaluate(model, identity)}")
                save(model, identity, f"checkpoint-{step}", loaders[identity.adapter])
    for identity in identities:
        save(model, identity, "last-checkpoint", loaders[identity.adapter])


if __name__ == "__main__":
    train()
