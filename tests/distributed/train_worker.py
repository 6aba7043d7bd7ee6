"""A few training steps of the contract's pipeline, for the multi-process tests.

Run it as one process (``python train_worker.py ...``) or under torchrun
(``python -m torch.distributed.run --nproc_per_node N train_worker.py --fsdp-size F --dp-size D ...``).
Rank 0 writes ``OUT/result.json``: the per-step losses (reduced over ranks) and the final LoRA
weights, read back from the checkpoint ``OUT/final`` (``model.save`` writes full tensors). Every
rank writes ``OUT/pid_rank{r}`` first, so a test can check that no worker outlives the job, and
at the end ``OUT/threads_rank{r}.json``: the names of its threads still running after
``twinkle.runtime.shutdown()``."""

import argparse
import json
import os
import time
from pathlib import Path

import torch
from peft import LoraConfig
from safetensors.torch import load_file

import twinkle
from twinkle import DeviceMesh
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.model import TransformersModel
from twinkle.preprocessor import SelfCognitionProcessor

GLOBAL_BATCH = 4


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model-id", required=True)
    p.add_argument("--optimizer", choices=("AdamW", "Muon"), default="AdamW")
    p.add_argument("--fsdp-size", type=int, default=None)
    p.add_argument("--dp-size", type=int, default=None)
    p.add_argument("--steps", type=int, required=True, help="micro-batches in the whole run (the data)")
    p.add_argument("--out", required=True)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument(
        "--fail-save-rank", type=int, default=None, help="this rank's checkpoint writes hit a full disk"
    )
    p.add_argument("--task", choices=("causal_lm", "fused_lm_ce"), default="causal_lm")
    p.add_argument("--activation-checkpointing", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--save-at", type=int, default=None, help="also save OUT/step-S after micro-batch S")
    p.add_argument("--resume", default=None, help="checkpoint folder to resume from")
    p.add_argument("--resume-only-model", action="store_true")
    p.add_argument("--fail-rank", type=int, default=None)
    p.add_argument("--fail-at-step", type=int, default=None, help="raise on --fail-rank before micro-batch S")
    return p.parse_args()


def build_model(args: argparse.Namespace, num_training_steps: int) -> TransformersModel:
    model = TransformersModel(
        model_id=args.model_id,
        dtype=getattr(torch, args.dtype),
        activation_checkpointing=args.activation_checkpointing,
    )
    discovered = {
        type(m).__name__ for m in model.model.modules() if type(m).__name__.endswith("DecoderLayer")
    }
    model.model._no_split_modules = sorted(discovered)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    model.add_adapter_to_model("default", lora, gradient_accumulation_steps=args.grad_accum)
    if args.optimizer == "Muon":
        model.set_optimizer(optimizer_cls=torch.optim.Muon, lr=1e-2, adjust_lr_fn="match_rms_adamw")
    else:
        model.set_optimizer(optimizer_cls="AdamW", lr=1e-2)
    # One warm-up step, so every step of a short run trains at a sizeable learning rate.
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=1, num_training_steps=num_training_steps)
    return model


def main() -> tuple[Path, int]:
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mesh = DeviceMesh.from_sizes(fsdp_size=args.fsdp_size, dp_size=args.dp_size)
    # A short collective timeout: a dead peer must end the job in seconds, not in 10 minutes.
    runtime = twinkle.initialize(mode="local", global_device_mesh=mesh, timeout_s=30)
    if runtime.rank == args.fail_save_rank:
        import errno

        import twinkle.checkpoint.save as save_module

        def disk_full(obj, path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))

        save_module._torch_save = disk_full
    (out / f"pid_rank{runtime.rank}").write_text(str(os.getpid()))

    dataset = Dataset(dataset_meta=DatasetMeta(None, data_slice=range(args.steps * GLOBAL_BATCH)))
    dataset.set_template("Template", model_id=args.model_id, max_length=128)
    dataset.map(SelfCognitionProcessor("twinkle大模型", "ModelScope社区"))
    dataset.encode()
    dataloader = DataLoader(dataset=dataset, batch_size=GLOBAL_BATCH)
    model = build_model(args, len(dataloader))
    if args.resume:
        progress = model.resume_from_checkpoint(args.resume, resume_only_model=args.resume_only_model)
        if not args.resume_only_model:
            dataloader.resume_from_checkpoint(progress["consumed_train_samples"])

    group = model.optimizer_group["default"]
    steps = []
    for batch in dataloader:
        if runtime.rank == args.fail_rank and group.cur_step + 1 == args.fail_at_step:
            raise RuntimeError(f"injected failure on rank {runtime.rank} at step {args.fail_at_step}")
        model.forward_backward(inputs=batch, task=args.task)
        model.clip_grad_and_step()
        metric = model.calculate_metric(is_training=True)
        steps.append({"step": group.cur_step, "loss": metric["loss"], "grad_norm": metric["grad_norm"]})
        if group.cur_step == args.save_at:
            consumed = dataloader.get_state()["consumed_train_samples"]
            model.save(f"step-{args.save_at}", output_dir=str(out), consumed_train_samples=consumed)
    final = model.save(
        "final", output_dir=str(out), consumed_train_samples=dataloader.get_state()["consumed_train_samples"]
    )
    if runtime.rank == 0:
        weights = {k: v.tolist() for k, v in sorted(load_file(final / "adapter_model.safetensors").items())}
        result = {"world_size": runtime.world_size, "steps": steps, "weights": weights}
        (out / "result.json").write_text(json.dumps(result))
    return out, runtime.rank


def thread_names(settle_s: float = 5.0) -> list[str]:
    """The kernel's name of every thread of this process (gloo names its threads). A joined
    thread can linger in ``/proc/self/task`` for a moment after ``join`` returns, so this waits
    up to ``settle_s`` for the gloo names to go; a thread still running stays and is listed."""
    deadline = time.monotonic() + settle_s
    while True:
        names = []
        for task in Path("/proc/self/task").iterdir():
            try:
                names.append((task / "comm").read_text().strip())
            except FileNotFoundError:  # gone between the listing and the read
                pass
        if not any("gloo" in n for n in names) or time.monotonic() > deadline:
            return names
        time.sleep(0.05)


if __name__ == "__main__":
    # As in the contract, the model goes with main's frame; torch's caches still hold the mesh.
    out, rank = main()
    twinkle.runtime.shutdown()
    (out / f"threads_rank{rank}.json").write_text(json.dumps(thread_names()))
