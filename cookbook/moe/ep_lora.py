"""LoRA on a mixture-of-experts model with expert parallelism: attention and every expert trained,
each rank holding only its share of the experts.

    python cookbook/moe/ep_lora.py
    python cookbook/moe/ep_lora.py --max-steps 100 --output-dir output/ep
    torchrun --nproc_per_node 2 cookbook/moe/ep_lora.py --ep-size 2 --fsdp-size 2
    torchrun --nproc_per_node 8 cookbook/moe/ep_lora.py --model-id PATH/TO/Qwen3-30B-A3B --ep-size 8 --fsdp-size 8

Started without a launcher it starts its own: ``--ep-size`` ranks (2 by default) under torchrun
on this machine, so with no flags it runs EP 2 over 2 FSDP2 ranks on a CPU (gloo). With no
``--model-id`` it trains a mixture-of-experts model made at first use into the Twinkle cache from
the bundled SmolLM2-135M-Instruct (``moe_checkpoint.py``: 4 of its 30 layers become 8 experts,
top-2), which starts as SmolLM2 does: the loss falls from about 2 to about 1 in 20 steps, a few
minutes on two cores. Any checkpoint of a family ``twinkle.model.expert_parallel.FAMILIES`` names
works the same.

Its defaults are in ``ep_lora.yaml`` beside it. The data is the bundled self-cognition set
(``--dataset-id`` for your own). LoRA goes on the attention projections (``--target-modules``)
and on the experts' fused weights (``target_parameters``: ``mlp.experts.gate_up_proj`` and
``mlp.experts.down_proj``, which ``target_modules`` cannot reach). Each rank keeps
``num_experts / ep_size`` experts and sends each token to the rank holding each expert it chose;
FSDP2 shards everything else, the experts' LoRA included, so the adapter saved at the end
(``OUTPUT_DIR/last-checkpoint``, PEFT's format) is the whole model's. The loss is logged every
``--log-interval`` steps, and the first and last logged losses at the end."""

import os
import subprocess
import sys
from pathlib import Path

from peft import LoraConfig

import twinkle
from twinkle import DeviceMesh, get_device_placement, get_logger
from twinkle.cli import CLI
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.model import TransformersModel
from twinkle.preprocessor import SelfCognitionProcessor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_checkpoint import moe_checkpoint  # noqa: E402  (beside this script)

EXPERT_WEIGHTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]

logger = get_logger()
args = CLI.from_args(config_file=Path(__file__).with_name("ep_lora.yaml"))


def launch_ranks() -> int:
    """Run this script again as ``--ep-size`` ranks under torchrun (one per expert block, FSDP2
    over all of them), the model built first so the ranks do not wait on each other for it."""
    ranks = args.infra.ep_size or 2
    added = [] if args.infra.ep_size else ["--ep-size", str(ranks)]
    added += [] if args.infra.fsdp_size else ["--fsdp-size", str(ranks)]
    added += [] if args.model.model_id else ["--model-id", moe_checkpoint(seed=args.infra.seed)]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    logger.info(f"starting {ranks} ranks: ep_size {ranks}, FSDP2 over {ranks}")
    return subprocess.run([*command, __file__, *sys.argv[1:], *added]).returncode


def build_dataset(model_id: str) -> Dataset:
    samples = args.training.train_samples
    dataset = Dataset(DatasetMeta(args.dataset.dataset_id, data_slice=range(samples) if samples else None))
    dataset.set_template(args.template.template_cls, model_id=model_id, max_length=args.template.max_length)
    dataset.map(
        SelfCognitionProcessor(
            args.extra.get("model_name", "Twinkle"), args.extra.get("model_author", "Acme")
        )
    )
    dataset.encode()
    return dataset


def train() -> None:
    mesh = DeviceMesh.from_sizes(
        fsdp_size=args.infra.fsdp_size, dp_size=args.infra.dp_size, ep_size=args.infra.ep_size
    )
    twinkle.initialize(mode=args.infra.mode, global_device_mesh=mesh)
    model_id = args.model.model_id or moe_checkpoint(seed=args.infra.seed)
    dataloader = DataLoader(
        dataset=build_dataset(model_id),
        batch_size=args.training.batch_size,
        shuffle=True,
        seed=args.infra.seed,
    )
    model = TransformersModel(
        model_id=model_id,
        # upstream's switch; the mesh's ep_size says how many blocks the experts are split into
        fsdp_config={
            "expert_parallel": {"enabled": True, "router_dtype": "fp32", "keep_router_logits": False}
        },
    )
    layers = {type(m).__name__ for m in model.model.modules() if type(m).__name__.endswith("DecoderLayer")}
    model.model._no_split_modules = sorted(layers)  # FSDP2 shards layer by layer
    lora = LoraConfig(
        r=args.lora.lora_r,
        lora_alpha=args.lora.lora_alpha,
        lora_dropout=args.lora.lora_dropout,
        target_modules=args.lora.target_modules.split(","),
        target_parameters=EXPERT_WEIGHTS,  # each expert's own rank-r update of the fused weights
    )
    model.add_adapter_to_model(args.lora.adapter_name, lora)
    model.set_optimizer(args.optimizer.optimizer_cls, lr=args.optimizer.learning_rate)
    max_steps = args.training.max_steps
    model.set_lr_scheduler(
        scheduler_cls=args.scheduler.scheduler_cls,
        num_warmup_steps=args.scheduler.num_warmup_steps,
        num_training_steps=max_steps,
    )
    logger.info(get_device_placement())
    logger.info(model.get_train_configs())

    losses: list[float] = []
    step = 0
    while step < max_steps:
        for batch in dataloader:
            model.forward_backward(inputs=batch)
            model.clip_grad_and_step(max_grad_norm=args.optimizer.max_grad_norm)
            step += 1
            if step % args.training.log_interval == 0 or step == max_steps:
                metric = model.calculate_metric(is_training=True)
                losses.append(metric["loss"])
                logger.info(
                    f"step {step}/{max_steps}: loss {metric['loss']:.3f}, grad_norm {metric['grad_norm']:.3f}"
                )
            if step == max_steps:
                break
    path = model.save("last-checkpoint", output_dir=args.training.output_dir, save_optimizer=False)
    logger.info(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {max_steps} steps; adapter saved to {path}")


if __name__ == "__main__":
    if "WORLD_SIZE" not in os.environ and args.infra.mode == "local" and (args.infra.ep_size or 2) > 1:
        sys.exit(launch_ranks())
    train()
