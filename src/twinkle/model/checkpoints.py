"""``TransformersModel``'s checkpoints: save, resume, load, the adapter's state dict, and the
save of a preempted run."""

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from twinkle.checkpoint import (
    layout,
    load_checkpoint,
    read_trainer_state,
    rotate_checkpoints,
    save_checkpoint,
)
from twinkle.checkpoint.load import load_state_parts
from twinkle.distributed.collectives import all_reduce_sum
from twinkle.loss.registry import loss_record
from twinkle.metric import report
from twinkle.model.full_parameter import FULL
from twinkle.model.lora import lora_signature
from twinkle.model.resume import check_resumable, fast_forward_scheduler
from twinkle.model.step import local_grad
from twinkle.model.train_state import OptimizerGroup
from twinkle.runtime import preemption
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

logger = get_logger()


class Checkpoints:
    """Mixed into ``TransformersModel`` (which provides ``model``, ``tokenizer``, ``runtime``,
    ``adapters``, ``_group``, ...); ``save_and_exit`` is what the step calls on a SIGTERM."""

    def _trainer_state(self, group: OptimizerGroup, consumed_train_samples: int) -> dict[str, Any]:
        return {
            **group.state_dict(),
            "consumed_train_samples": consumed_train_samples,
            "world_size": self.runtime.world_size,
            "mesh": [self.runtime.mesh.dp_size, self.runtime.mesh.fsdp_size],
            "model_path": str(self.model_path),
            "base_model": self.model_id or "bundled:SmolLM2-135M-Instruct",
            "base_dtype": str(base_dtype(self.model)),
            "lora": lora_signature(self.adapters.lora_config(group.adapter_name)),
            # the loss it was trained with and its arguments: ``twinkle eval`` rebuilds it
            **(loss_record(group.loss_fn) if group.loss_fn is not None else {}),
        }

    def save(
        self,
        name: str | None = None,
        output_dir: str | None = "output",
        adapter_name: str | None = None,
        save_optimizer: bool = True,
        consumed_train_samples: int = 0,
        save_total_limit: int | None = None,
        metric: float | None = None,
        keep: Sequence[str] = (),
        interval: int = 1,
    ) -> Path | None:
        """Write ``output_dir/name`` completely under a temporary name, then rename it into place.

        ``name`` None is ``checkpoint-<step>``; ``output_dir`` None is ``output``. ``interval``:
        save only when the step count (micro-batches, ``cur_step``) is a multiple of it, so a
        loop may call ``save`` every step; otherwise nothing is written and None is returned.
        ``metric`` (an eval loss, lower is better) is stored with the checkpoint. With
        ``save_total_limit``, the oldest complete ``checkpoint-*`` folders beyond it are then
        deleted, except the newest, the one with the lowest stored metric and those in ``keep``
        (``twinkle.checkpoint.rotate_checkpoints``)."""
        group = self._group(adapter_name)
        self.adapters.activate(group.adapter_name)  # the saved RNG state is this adapter's stream
        if not isinstance(interval, int) or interval < 1:
            raise UserError(
                f"save(interval={interval!r}): interval must be a positive integer (1 saves every call)"
            )
        if group.cur_step % interval:
            return None
        name = f"checkpoint-{group.cur_step}" if name is None else name
        output_dir = "output" if output_dir is None else output_dir
        if save_total_limit is not None and save_total_limit < 1:
            raise UserError(
                f"save_total_limit must be at least 1 (or None to keep all), got {save_total_limit}"
            )
        out = Path(output_dir).expanduser()
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(
                f"cannot create --output-dir {out} ({exc.strerror}); choose a writable folder"
            ) from exc
        grads = {}
        if group.window_batches:  # an open accumulation window: keep its partial gradients
            params = self.adapters.window_params(group.adapter_name)
            grads = {n: local_grad(p) for n, p in params if p.grad is not None}
        path = save_checkpoint(
            out / name,
            model=self.model,
            tokenizer=self.tokenizer,
            adapter_name=group.adapter_name,
            group=group,
            trainer_state={**self._trainer_state(group, consumed_train_samples), "metric": metric},
            save_optimizer=save_optimizer,
            rank=self.runtime.rank,
            grads=grads,
            export=self.adapters.export(group.adapter_name),
        )
        logger.info(f"saved checkpoint {path}")
        report.on_save(self.runtime, group, path)  # the run summary names it (twinkle.metric.report)
        if save_total_limit is not None and self.runtime.rank == 0:
            for deleted in rotate_checkpoints(out, save_total_limit, keep=keep):
                logger.info(f"deleted checkpoint {deleted} (save_total_limit={save_total_limit})")
        return path

    def resume_from_checkpoint(
        self, checkpoint_dir: str, resume_only_model: bool = False, adapter_name: str | None = None
    ) -> dict[str, int]:
        """Restore adapter ``adapter_name`` from ``checkpoint_dir`` (``resume_only_model``: its
        weights only, the step counters kept); other adapters keep their weights, state and open
        windows. Returns ``{"consumed_train_samples", "cur_step"}``."""
        group = self._group(adapter_name)
        self.adapters.activate(group.adapter_name)  # the restored RNG state becomes its stream
        folder = Path(checkpoint_dir).expanduser()
        state = read_trainer_state(folder)
        layout.require_fields(
            folder, state, layout.ONLY_MODEL_FIELDS if resume_only_model else layout.RESUME_FIELDS
        )
        if group.adapter_name == FULL and not (group.cur_step or resume_only_model):
            # the implicit group's window is set per call (clip_grad_and_step), never before a resume
            group.gradient_accumulation_steps = int(state["gradient_accumulation_steps"])
        check_resumable(folder, state, self._trainer_state(group, 0), resume_only_model)
        if group.optimizer is None or group.lr_scheduler is None:
            logger.warning(
                "resume_from_checkpoint before set_optimizer/set_lr_scheduler: their state is not restored"
            )
        window = load_checkpoint(
            folder,
            model=self.model,
            adapter_name=group.adapter_name,
            group=group,
            rank=self.runtime.rank,
            only_model=resume_only_model,
            load_weights=lambda f: self.adapters.load_weights(f, group.adapter_name),
        )
        if resume_only_model:
            # Fresh optimizer state, but the run keeps its place: the step counters continue and
            # the schedule is advanced to them, so data skipping, logging and the LR agree. The
            # gradients of an open accumulation window are not restored.
            group.cur_step, group.optimizer_steps = int(state["cur_step"]), int(state["optimizer_steps"])
            fast_forward_scheduler(group.lr_scheduler, group.optimizer_steps)
        else:
            group.load_state_dict(state)
            # trainer_state.json holds rank 0's count of the open window; each rank needs its own,
            # or the step divides the window's gradients by the wrong global token count.
            group.window_tokens = int(window.get("window_tokens", group.window_tokens))
            self.adapters.restore_window_grads(group.adapter_name, window["grads"])
        if group.optimizer is not None:
            group.optimizer.sync_copies()
        group.resumed_samples, group.local_samples = int(state["consumed_train_samples"]), 0
        logger.info(f"resumed from {folder} at step {group.cur_step}")
        return {"consumed_train_samples": int(state["consumed_train_samples"]), "cur_step": group.cur_step}

    def load(
        self,
        name: str,
        output_dir: str | None = None,
        adapter_name: str | None = None,
        load_optimizer: bool = False,
    ) -> Path:
        """Load the adapter weights of a folder (``output_dir/name``, or the path ``name``) that
        ``save`` or PEFT's ``save_pretrained`` wrote into adapter ``adapter_name``; with
        ``load_optimizer`` also the optimizer and schedule state. Unlike
        ``resume_from_checkpoint``, the step counters, data position and RNG stay as they are.
        Returns the folder."""
        group = self._group(adapter_name)
        folder = Path(name).expanduser() if output_dir is None else Path(output_dir).expanduser() / name
        if not folder.is_dir():
            raise UserError(
                f"load: {folder} is not a folder; pass name=<folder path>, or name=<folder name> with output_dir=<its parent>"
            )
        if (folder / layout.TRAINER_STATE).exists() or (folder / layout.MARKER).exists():
            read_trainer_state(folder)  # a Twinkle checkpoint: refuse an interrupted or damaged one
        config_file, weights_file = folder / layout.ADAPTER_CONFIG, folder / layout.ADAPTER_WEIGHTS
        if not (config_file.is_file() and weights_file.is_file()):
            raise UserError(
                f"{folder} holds no LoRA adapter ({layout.ADAPTER_CONFIG} and {layout.ADAPTER_WEIGHTS}); "
                "pass a folder that model.save(...) or PEFT's save_pretrained wrote"
            )
        self._check_lora_matches(folder, group)
        if load_optimizer and group.optimizer is None:
            raise UserError(
                "load(..., load_optimizer=True) restores the optimizer: call set_optimizer(...) first"
            )
        if load_optimizer and not (folder / layout.OPTIMIZER).is_file():
            raise UserError(
                f"{folder} holds no optimizer state ({layout.OPTIMIZER}); it was saved with save_optimizer=False, "
                "so load it with load_optimizer=False"
            )
        if load_optimizer:  # checked, read as data and loaded before the weights are replaced
            load_state_parts(folder, group)
        self.adapters.load_weights(folder, group.adapter_name)
        if group.optimizer is not None:
            group.optimizer.sync_copies()
        logger.info(f"loaded adapter {group.adapter_name!r} from {folder}")
        return folder

    def _check_lora_matches(self, folder: Path, group: OptimizerGroup) -> None:
        from peft import LoraConfig

        try:
            saved = lora_signature(LoraConfig.from_pretrained(str(folder)))
        except (TypeError, ValueError, AttributeError) as exc:
            raise UserError(
                f"{folder / layout.ADAPTER_CONFIG} is not a LoRA config this PEFT reads ({exc})"
            ) from exc
        current = lora_signature(self.adapters.lora_config(group.adapter_name))
        if saved != current:
            raise UserError(
                f"{folder} holds a LoRA adapter {saved}, adapter {group.adapter_name!r} is {current}; "
                "add the adapter with the same r, lora_alpha and target_modules"
            )

    def get_state_dict(self, adapter_name: str | None = None) -> dict[str, torch.Tensor]:
        """The adapter's weights, full size on the CPU, under the names of its
        ``adapter_model.safetensors`` (PEFT's, without the adapter name). Under FSDP every rank
        must call it (the shards are gathered)."""
        return self.adapters.state_dict(self._group(adapter_name).adapter_name)


def base_dtype(model: Any) -> torch.dtype:
    """The dtype of the frozen base weights; of any weight when every weight trains
    (full-parameter)."""
    frozen = next((p for p in model.parameters() if not p.requires_grad), None)
    return (frozen if frozen is not None else next(model.parameters())).dtype


def save_and_exit(model: Any, group: OptimizerGroup) -> None:
    """Preempted (SIGTERM): ``model.save`` ``checkpoint-<step>`` under the run's output dir and exit
    with ``PREEMPTED_EXIT_CODE``; ``--resume-from-checkpoint auto`` continues from it."""
    (samples,) = all_reduce_sum([group.local_samples])
    output_dir = model.runtime.defaults.output_dir
    logger.warning(f"SIGTERM: saving checkpoint-{group.cur_step} under {output_dir} and exiting")
    model.save(
        f"checkpoint-{group.cur_step}",
        output_dir=output_dir,
        adapter_name=group.adapter_name,
        consumed_train_samples=group.resumed_samples + int(samples),
    )
    raise SystemExit(preemption.PREEMPTED_EXIT_CODE)
