"""DPO with LoRA, the reference being the base model itself: the reference pass runs the same
model with its adapters off (``forward_only(..., disable_lora=True)``), so no second copy is loaded.

    python cookbook/rl/dpo_lora.py
    python cookbook/rl/dpo_lora.py --model-name Pip --model-author Acme --output-dir output/dpo
    python cookbook/rl/dpo_lora.py --dataset-id my_pairs.jsonl --eval-samples 50
    torchrun --nproc_per_node 2 cookbook/rl/dpo_lora.py --fsdp-size 2
    python cookbook/rl/dpo_lora.py --mode ray --fsdp-size 2

Its defaults are the CLI's and those of ``dpo_lora.yaml`` beside it (``--sft-weight 1``: the
chosen reply's cross-entropy joins the DPO loss, as upstream's script does). With no flags it
trains the bundled SmolLM2-135M-Instruct on the bundled ``self-cognition-dpo`` pairs (the answer
as ``--model-name``/``--model-author`` preferred over a generic or another assistant's identity,
Chinese and English) and evaluates on their held-out split. A
``--dataset-id`` of your own holds rows ``prompt``/``chosen``/``rejected`` (text or message
lists) or ``messages`` with a final ``chosen``/``rejected`` reply (``PreferenceProcessor``);
``--eval-samples N`` then holds its first N pairs out.

Every step: the reference pass, then the policy's DPO forward/backward, then the optimizer step.
``--batch-size`` counts pairs (each batch is ``[chosen_1, rejected_1, ...]``, and a pair never
spans two data-parallel ranks). ``--beta``, ``--loss-type`` (sigmoid, hinge, ipo) and
``--sft-weight`` set ``DPOLoss``; ``DPOMetric`` reports the chosen/rejected log-probs and rewards,
``reward_margin`` and ``reward_accuracy`` to the log and ``OUTPUT_DIR/metrics.jsonl`` (curves in
``curves.png``). The held-out pairs are evaluated before training, every ``--eval-interval``
steps (default: none between) and at the end. ``--save-steps N`` saves ``checkpoint-<step>``;
the PEFT adapter of the last step is ``last-checkpoint`` (``twinkle chat --adapter
OUTPUT_DIR/last-checkpoint``).

``--mode ray`` runs this loop as a single controller (``twinkle.runtime.controller``): this
process drives it, and the model and its DataLoaders live on a device group ``model`` of
``--fsdp-size`` x ``--dp-size`` ranks (FSDP2 among them; ``--model-gpus N``: N ranks), on a
local Ray cluster or ``--ray-address``; each rank reads its share of every batch as it would
under torchrun, and the losses are one process's. ``--max-restarts K``: a rank that dies
restarts the run from its newest complete checkpoint (``--save-steps``), up to K times.
"""

from pathlib import Path

from peft import LoraConfig

import twinkle
from twinkle import DeviceGroup, DeviceMesh, get_device_placement, get_logger
from twinkle.cli import CLI
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.kernel import kernelize
from twinkle.loss import DPOLoss
from twinkle.metric import DPOMetric
from twinkle.model import TransformersModel
from twinkle.preprocessor import PreferenceProcessor, SelfCognitionDPOProcessor
from twinkle.runtime.remote import Sharded
from twinkle.utils.errors import UserError
from twinkle.utils.framework import Torch

BUNDLED = "self-cognition-dpo"
# One pass over the 120 bundled training pairs (30 steps of 4): on SmolLM2-135M the held-out reward
# accuracy reaches 1.0 by step 10.
DEFAULT_TRAIN_PAIRS = 120
MODEL_GROUP = "model"  # --mode ray: the device group of the model and its DataLoaders

logger = get_logger()
args = CLI.from_args(config_file=Path(__file__).with_name("dpo_lora.yaml"))  # the defaults it ships
MESH = DeviceMesh.from_sizes(fsdp_size=args.infra.fsdp_size, dp_size=args.infra.dp_size,
                             world_size=args.infra.model_gpus if args.infra.mode == "ray" else None)  # fmt: skip
GROUPS = [DeviceGroup(name=MODEL_GROUP, ranks=MESH.world_size, device_type=Torch.device_type())]
twinkle.initialize(mode=args.infra.mode, global_device_mesh=MESH,
                   groups=GROUPS if args.infra.mode == "ray" else None)  # fmt: skip


def build_dataset(split: str, rows: range | None) -> Dataset:
    """The pairs of ``split`` (``rows`` of it), encoded: both sides of each pair."""
    dataset_id = args.dataset.dataset_id or BUNDLED
    if dataset_id == BUNDLED:
        processor = SelfCognitionDPOProcessor(
            args.extra.get("model_name", "twinkle大模型"), args.extra.get("model_author", "ModelScope社区")
        )
    else:
        processor = PreferenceProcessor()
    dataset = Dataset(DatasetMeta(dataset_id, subset_name=args.dataset.subset_name, split=split,
                                  data_slice=rows))  # fmt: skip
    dataset.set_template(args.template.template_cls, model_id=args.model.model_id,
                         max_length=args.template.max_length,
                         truncation_strategy=args.template.truncation_strategy,
                         default_system=args.template.default_system)  # fmt: skip
    dataset.map(processor)
    return dataset.encode()


def datasets() -> tuple[Dataset, Dataset | None]:
    """(training pairs, held-out pairs): the bundled set's ``eval`` split, or the first
    ``--eval-samples`` pairs of your own set."""
    wanted = args.training.train_samples
    if (args.dataset.dataset_id or BUNDLED) == BUNDLED:
        held_out = range(args.training.eval_samples) if args.training.eval_samples else None
        return build_dataset("train", range(wanted or DEFAULT_TRAIN_PAIRS)), build_dataset("eval", held_out)
    held_out = args.training.eval_samples or 0
    meta = DatasetMeta(
        args.dataset.dataset_id, subset_name=args.dataset.subset_name, split=args.dataset.split
    )
    total = len(Dataset(meta))
    if held_out >= total:
        raise UserError(f"--eval-samples {held_out} leaves no pair of {total} to train on; hold out fewer")
    train_rows = range(held_out, held_out + (wanted or total - held_out))
    split = args.dataset.split
    return build_dataset(split, train_rows), build_dataset(split, range(held_out)) if held_out else None


def evaluate(model: TransformersModel, pairs: DataLoader, refs: list) -> dict[str, float]:
    """The DPO loss and metrics of the held-out pairs: the policy's pass on each batch with the
    reference's log-probs. The reference (the base model) never changes: its pass runs at the
    first evaluation only and ``refs`` keeps each batch's log-probs for the later ones (under
    ``--mode ray`` each rank's part, held here: the ranks keep only their last few values)."""
    for index, batch in enumerate(pairs):
        if index == len(refs):
            ref = model.forward_only(inputs=batch, disable_lora=True)
            refs.append(ref.fetch("logps") if isinstance(ref, Sharded) else {"logps": ref["logps"]})
        model.forward_only(inputs=batch, ref_outputs=refs[index])
        model.calculate_loss()
    return model.calculate_metric(is_training=False)


def main() -> None:
    # built first: a bad --beta or --loss-type combination stops the run before any loading
    loss = DPOLoss(beta=args.loss.beta, loss_type=args.loss.loss_type, sft_weight=args.loss.sft_weight,
                   label_smoothing=args.loss.label_smoothing)  # fmt: skip
    train_set, eval_set = datasets()
    train = DataLoader(dataset=train_set, batch_size=args.training.batch_size, shuffle=True,
                       seed=args.infra.seed, device_mesh=MESH, remote_group=MODEL_GROUP)  # fmt: skip
    pairs = None if eval_set is None else DataLoader(dataset=eval_set, batch_size=args.training.batch_size,
                                                     device_mesh=MESH, remote_group=MODEL_GROUP)  # fmt: skip
    model = kernelize(
        TransformersModel(model_id=args.model.model_id, device_mesh=MESH, remote_group=MODEL_GROUP)
    )
    model.add_adapter_to_model(args.lora.adapter_name, LoraConfig(**args.get_lora_args()),
                               gradient_accumulation_steps=args.training.gradient_accumulation_steps)  # fmt: skip
    model.set_optimizer(args.optimizer.optimizer_cls, lr=args.optimizer.learning_rate)
    max_steps, save_steps = args.training.max_steps, args.training.save_steps
    horizon = len(train)  # in micro-batches; with --max-steps the schedule ends at the last step taken
    if max_steps is not None:
        horizon = min(horizon, max_steps * args.training.gradient_accumulation_steps)
    model.set_lr_scheduler(args.scheduler.scheduler_cls, num_warmup_steps=args.scheduler.num_warmup_steps,
                           num_training_steps=horizon)  # fmt: skip
    model.set_loss(loss)
    model.add_metric(DPOMetric, beta=args.loss.beta)
    if args.training.resume_from_checkpoint:
        progress = model.resume_from_checkpoint(args.training.resume_from_checkpoint)
        train.resume_from_checkpoint(progress["consumed_train_samples"])
    logger.info(get_device_placement())
    logger.info(model.get_train_configs())
    logger.info("reference: the base model (forward_only with disable_lora=True), no second copy loaded")

    def save(name: str) -> None:
        model.save(name, output_dir=args.training.output_dir,
                   consumed_train_samples=train.get_state()["consumed_train_samples"])  # fmt: skip

    group = model.optimizer_group[args.lora.adapter_name]
    eval_interval = args.training.eval_interval or horizon  # default: before training and at the end
    eval_refs: list[dict] = []
    if eval_set is not None:
        logger.info(f"eval at step {group.cur_step}: {evaluate(model, pairs, eval_refs)}")
    done = max_steps is not None and group.optimizer_steps >= max_steps  # a resumed run may be done
    for batch in [] if done else train:
        updates = group.optimizer_steps
        ref = model.forward_only(inputs=batch, disable_lora=True)
        model.forward_backward(inputs=batch, ref_outputs=ref)
        model.clip_grad_and_step(max_grad_norm=args.optimizer.max_grad_norm)
        step, stepped = group.cur_step, group.optimizer_steps > updates
        if step % args.training.log_interval == 0:
            logger.info(f"step {step} of {horizon}: {model.calculate_metric(is_training=True)}")
        if eval_set is not None and step % eval_interval == 0 and step < horizon:
            logger.info(f"eval at step {step}: {evaluate(model, pairs, eval_refs)}")
        if save_steps is not None and stepped and group.optimizer_steps % save_steps == 0:
            save(f"checkpoint-{step}")
        if max_steps is not None and group.optimizer_steps >= max_steps:
            logger.info(f"--max-steps {max_steps}: stopping after optimizer step {group.optimizer_steps}")
            break
    if eval_set is not None:
        logger.info(f"final eval at step {group.cur_step}: {evaluate(model, pairs, eval_refs)}")
    save("last-checkpoint")


if __name__ == "__main__":
    main()
