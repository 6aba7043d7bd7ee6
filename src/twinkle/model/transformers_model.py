"""``TransformersModel``: a Hugging Face causal LM with LoRA adapters and an explicit step API.

The script drives the loop; this class holds the pieces and keeps the step semantics:
gradients are summed over the micro-batches of an accumulation window and divided by the
window's supervised-token count over all ranks right before the optimizer step, so the update
is the mean over every supervised token of the global batch, whatever the padding or sharding."""

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from twinkle.checkpoint import load_checkpoint, read_trainer_state, rotate_checkpoints, save_checkpoint
from twinkle.distributed.collectives import all_reduce_sum
from twinkle.distributed.fsdp import apply_fsdp2
from twinkle.kernel import cpu_gemm as gemm
from twinkle.loss import FusedLinearCrossEntropyLoss, build_loss
from twinkle.model.activation_checkpointing import LayerCheckpointing
from twinkle.model.forward import causal_lm_of, compute_loss
from twinkle.model.loading import load_causal_lm, resolve_dtype
from twinkle.model.lora import add_lora, lora_signature, trainable_parameters
from twinkle.model.resume import check_resumable, fast_forward_scheduler
from twinkle.model.step import clip_gradients, local_grad, restore_grad
from twinkle.model.train_state import OptimizerGroup
from twinkle.optim import build_optimizer, build_scheduler
from twinkle.optim.replicated import ReplicatedOptimizer
from twinkle.runtime import get_runtime, preemption, run_defaults
from twinkle.template.base import IGNORE_INDEX
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

TASKS = ("causal_lm", "fused_lm_ce")
logger = get_logger()


class TransformersModel:
    def __init__(
        self,
        model_id: str | None = None,
        dtype: torch.dtype | None = None,
        padding_free: bool = True,
        activation_checkpointing: str | None = None,
    ):
        """``dtype``: the weights' dtype; None takes the run defaults' (``--dtype``; ``auto``: bf16
        on accelerators, fp32 on CPU). ``padding_free``: run each batch packed into one row (same
        loss; see ``twinkle.model.packing``). ``activation_checkpointing``: ``auto`` (only for a
        batch whose activations would not fit), ``on`` or ``off``; None takes the run defaults'
        (``--activation-checkpointing``, else ``auto``; see
        ``twinkle.model.activation_checkpointing``)."""
        runtime = get_runtime()
        self.padding_free = padding_free
        defaults = run_defaults()
        if activation_checkpointing is None:
            activation_checkpointing = defaults.activation_checkpointing
        if dtype is None:
            dtype = resolve_dtype(defaults.dtype, runtime.device)
        gemm.bound_onednn_caches()  # before any oneDNN kernel is built (see twinkle.kernel.cpu_gemm)
        self.runtime = runtime
        self.device = runtime.device
        self.model_id = model_id
        self.model, self.tokenizer, self.model_path = load_causal_lm(model_id, self.device, dtype)
        self.checkpointing = LayerCheckpointing(self.model, activation_checkpointing)
        self.optimizer_group: dict[str, OptimizerGroup] = {}
        self._pending_eval: tuple[str, Any, int, int] | None = None
        self._in_train_mode = False  # set by forward_backward's train(), cleared by forward_only's eval()

    # ----------------------------------------------------------------- set-up
    def _group(self, adapter_name: str | None) -> OptimizerGroup:
        if adapter_name is None:
            if len(self.optimizer_group) != 1:
                names = ", ".join(self.optimizer_group) or "none yet"
                raise UserError(f"name the adapter (adapter_name=...); adapters: {names}")
            return next(iter(self.optimizer_group.values()))
        if adapter_name not in self.optimizer_group:
            raise UserError(
                f"unknown adapter {adapter_name!r}; adapters: {', '.join(self.optimizer_group) or 'none'}"
            )
        return self.optimizer_group[adapter_name]

    def add_adapter_to_model(
        self, adapter_name: str, config: Any, gradient_accumulation_steps: int = 1
    ) -> None:
        if gradient_accumulation_steps < 1:
            raise UserError(
                f"--gradient-accumulation-steps must be at least 1, got {gradient_accumulation_steps}"
            )
        if self.runtime.is_distributed and self.optimizer_group:
            raise UserError(
                "under FSDP a model takes one LoRA adapter (its weights are sharded with the model); "
                f"it already has {', '.join(self.optimizer_group)}"
            )
        self.model = add_lora(self.model, adapter_name, config)
        if self.runtime.is_distributed:
            lm = causal_lm_of(self.model)
            apply_fsdp2(lm, self.runtime.mesh, self.device, getattr(lm, "_no_split_modules", None))
            # Every rank drew the same LoRA initialisation (one seed); from here on each rank
            # needs its own stream, or all ranks would draw the same dropout masks.
            torch.manual_seed(self.runtime.seed + 1_000_003 * self.runtime.rank)
        elif self.device.type == "cpu":
            self._pack_frozen_weights()
        self.optimizer_group[adapter_name] = OptimizerGroup(
            adapter_name, gradient_accumulation_steps, loss_fn=build_loss("CrossEntropyLoss")
        )

    def _pack_frozen_weights(self) -> None:
        """The frozen linear weights' forward products from oneDNN-packed copies (see
        ``twinkle.kernel.cpu_gemm.pack_frozen``): unsharded CPU training only, as the copies cost
        the weights' memory again."""
        weights = [m.weight for m in self.model.modules() if isinstance(m, torch.nn.Linear)]
        packed = gemm.pack_frozen(weights)
        if packed:
            logger.info("frozen weights packed for oneDNN: %.0f MiB", packed / 2**20)

    def set_optimizer(
        self, optimizer_cls: Any, lr: float, adapter_name: str | None = None, **kwargs: Any
    ) -> None:
        """``optimizer_cls`` is a class or a ``torch.optim`` name; ``kwargs`` reach its constructor."""
        group = self._group(adapter_name)
        params = trainable_parameters(self.model)
        group.optimizer = ReplicatedOptimizer(
            params, lambda copies: build_optimizer(optimizer_cls, copies, lr=lr, **kwargs)
        )

    def set_lr_scheduler(
        self,
        scheduler_cls: Any,
        num_warmup_steps: int = 0,
        num_training_steps: int | None = None,
        adapter_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        """``num_training_steps`` counts micro-batches (``len(dataloader)``); the schedule runs
        over the optimizer steps they make, so it ends where the data ends."""
        group = self._group(adapter_name)
        if group.optimizer is None:
            raise UserError("call set_optimizer(...) before set_lr_scheduler(...)")
        if num_training_steps is None or num_training_steps < 1:
            raise UserError(f"num_training_steps must be at least 1, got {num_training_steps}")
        group.num_training_steps = num_training_steps
        optimizer_steps = -(-num_training_steps // group.gradient_accumulation_steps)
        group.lr_scheduler = build_scheduler(
            scheduler_cls, group.optimizer.optimizer, num_warmup_steps, optimizer_steps, **kwargs
        )
        group.last_lr = group.optimizer.param_groups[0]["lr"]

    def set_loss(self, loss: str, adapter_name: str | None = None, **kwargs: Any) -> None:
        self._group(adapter_name).loss_fn = build_loss(loss, **kwargs)

    # ----------------------------------------------------------------- steps
    def _to_device(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        batch = {k: v.to(self.device, non_blocking=True) for k, v in inputs.items() if torch.is_tensor(v)}
        if batch["input_ids"].shape[0] == 0:
            # This rank's share of a short last batch is empty, but under FSDP it must still join
            # every collective: run one pad token that carries no label.
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
            one = torch.ones((1, 1), dtype=torch.long, device=self.device)
            batch = {
                "input_ids": one * pad,
                "labels": one * IGNORE_INDEX,
                "attention_mask": one,
                "position_ids": one * 0,
            }
        return batch

    def _loss_fn(self, group: OptimizerGroup, task: str) -> Any:
        if task not in TASKS:
            raise UserError(f"unknown task {task!r}; valid tasks: {', '.join(TASKS)}")
        if task == "fused_lm_ce" and not isinstance(group.loss_fn, FusedLinearCrossEntropyLoss):
            group.loss_fn = FusedLinearCrossEntropyLoss(reduction=group.loss_fn.reduction)
        return group.loss_fn

    def forward_backward(
        self, inputs: dict[str, torch.Tensor], task: str = "causal_lm", adapter_name: str | None = None
    ) -> float:
        """One micro-batch: forward, summed loss, backward. Returns this rank's mean token loss.

        A model in eval mode (after ``forward_only``) is put back in training mode first."""
        group = self._group(adapter_name)
        group.train_metrics.start_batch()
        batch = self._to_device(inputs)
        # train() sets the flag on every module and reading them all walks them too (6.9 and
        # 2.1 ms for SmolLM2-135M with LoRA, 2499 modules): set once, and again after an eval()
        if not (self._in_train_mode and self.model.training):
            self.model.train()
            self._in_train_mode = True
        # positions the layers may run: the padded batch (a packed row is never longer)
        self.checkpointing.decide(batch["input_ids"].numel(), self.device)
        out = compute_loss(self.model, batch, self._loss_fn(group, task), self.padding_free)
        out.loss_sum.backward()  # even when not finite: under FSDP every rank must run backward
        loss_sum = float(out.loss_sum.detach())
        group.cur_step += 1
        group.local_samples += inputs["input_ids"].shape[0]
        group.window_batches += 1
        group.window_tokens += out.num_tokens
        if not math.isfinite(loss_sum):
            group.window_nonfinite = True
            return loss_sum  # kept out of the metrics, whose loss would otherwise read low
        group.train_metrics.update(
            loss_sum,
            out.num_tokens,
            int(out.num_correct),
            int(inputs["attention_mask"].sum()),
            inputs["input_ids"].shape[0],
        )
        return loss_sum / max(1, out.num_tokens)

    def clip_grad_and_step(
        self, max_grad_norm: float = 1.0, max_nonfinite_steps: int = 5, adapter_name: str | None = None
    ) -> bool:
        """Step the optimizer when the accumulation window is full; returns whether it stepped.

        A window whose loss or gradient is NaN/inf on any rank is dropped (counted in the
        ``nonfinite_steps`` metric); ``max_nonfinite_steps`` such windows in a row stop training."""
        group = self._group(adapter_name)
        if group.optimizer is None:
            raise UserError("call set_optimizer(...) before clip_grad_and_step()")
        if not group.window_is_full():
            return False
        # Gradients are per-rank sums (FSDP averages them over the ranks): rescale to the mean
        # over every supervised token of the window on all ranks. A SIGTERM on any rank rides
        # along, so every rank saves the same step.
        total, nonfinite, preempted = all_reduce_sum(
            [group.window_tokens, float(group.window_nonfinite), float(preemption.requested())]
        )
        stepped = False
        if total == 0:
            group.skipped_steps += 1
            logger.warning("no supervised token in this accumulation window; the optimizer step is skipped")
        else:
            group.optimizer.gather_grads(scale=self.runtime.world_size / total)
            grad_norm = clip_gradients(group.optimizer.copies, max_grad_norm)
            if nonfinite or not math.isfinite(grad_norm):
                self._drop_nonfinite_window(group, max_nonfinite_steps)
            else:
                group.last_grad_norm = grad_norm
                group.last_lr = group.optimizer.param_groups[0]["lr"]
                group.optimizer.step()
                group.optimizer_steps += 1
                group.consecutive_nonfinite = 0
                stepped = True
                if group.lr_scheduler is not None:
                    group.lr_scheduler.step()
        group.optimizer.zero_grad(set_to_none=True)
        group.window_tokens = group.window_batches = 0
        group.window_nonfinite = False
        if preempted:
            self._save_and_exit(group)
        return stepped

    def _save_and_exit(self, group: OptimizerGroup) -> None:
        """Preempted (SIGTERM): save ``checkpoint-<step>`` under the run's output dir and exit
        with ``PREEMPTED_EXIT_CODE``; ``--resume-from-checkpoint auto`` continues from it."""
        (samples,) = all_reduce_sum([group.local_samples])
        output_dir = run_defaults().output_dir
        logger.warning(f"SIGTERM: saving checkpoint-{group.cur_step} under {output_dir} and exiting")
        self.save(
            f"checkpoint-{group.cur_step}",
            output_dir=output_dir,
            adapter_name=group.adapter_name,
            consumed_train_samples=group.resumed_samples + int(samples),
        )
        raise SystemExit(preemption.PREEMPTED_EXIT_CODE)

    def _drop_nonfinite_window(self, group: OptimizerGroup, limit: int) -> None:
        group.nonfinite_steps += 1
        group.consecutive_nonfinite += 1
        logger.warning(
            f"NaN/inf loss or gradient at step {group.cur_step}: update skipped "
            f"({group.consecutive_nonfinite} in a row, {group.nonfinite_steps} in all)"
        )
        if group.consecutive_nonfinite >= limit:
            raise UserError(
                f"training diverged: {limit} optimizer steps in a row had a NaN/inf loss or gradient "
                f"(last at step {group.cur_step}); lower --lr, check the data, or resume from an earlier checkpoint"
            )

    @torch.no_grad()
    def forward_only(
        self, inputs: dict[str, torch.Tensor], task: str = "causal_lm", adapter_name: str | None = None
    ) -> float:
        """Evaluate one batch (no gradients, dropout off); ``calculate_loss()`` records it."""
        group = self._group(adapter_name)
        group.eval_metrics.start_batch()
        batch = self._to_device(inputs)
        if any(m.training for m in self.model.modules()):
            self.model.eval()
        self._in_train_mode = False
        out = compute_loss(self.model, batch, self._loss_fn(group, task), self.padding_free)
        self._pending_eval = (
            group.adapter_name,
            out,
            int(inputs["attention_mask"].sum()),
            inputs["input_ids"].shape[0],
        )
        return float(out.loss_sum) / max(1, out.num_tokens)

    def calculate_loss(self) -> float:
        """Record the last ``forward_only`` batch in the eval metrics; return its mean token loss."""
        if self._pending_eval is None:
            raise UserError("call forward_only(inputs=...) before calculate_loss()")
        name, out, input_tokens, samples = self._pending_eval
        self._pending_eval = None
        loss_sum = float(out.loss_sum)
        self.optimizer_group[name].eval_metrics.update(
            loss_sum, out.num_tokens, int(out.num_correct), input_tokens, samples
        )
        return loss_sum / max(1, out.num_tokens)

    def calculate_metric(self, is_training: bool = True, adapter_name: str | None = None) -> dict[str, float]:
        """Numbers since the last call, reduced over all ranks: loss, accuracy, tokens/s, and for
        training also grad_norm, lr, step counters."""
        group = self._group(adapter_name)
        if not is_training:
            return group.eval_metrics.compute()
        metrics = group.train_metrics.compute()
        metrics.update(
            grad_norm=group.last_grad_norm,
            lr=group.last_lr,
            step=group.cur_step,
            optimizer_steps=group.optimizer_steps,
            skipped_steps=group.skipped_steps,
            nonfinite_steps=group.nonfinite_steps,
        )
        return metrics

    def get_train_configs(self, adapter_name: str | None = None) -> str:
        group = self._group(adapter_name)
        params = trainable_parameters(self.model)
        n_train = sum(p.numel() for p in params)
        n_all = sum(p.numel() for p in self.model.parameters())
        sched = type(group.lr_scheduler).__name__ if group.lr_scheduler is not None else None
        return (
            f"model={self.model_path} device={self.device} dtype={next(self.model.parameters()).dtype} "
            f"adapter={group.adapter_name} trainable={n_train:,}/{n_all:,} ({100 * n_train / max(1, n_all):.2f}%) "
            f"optimizer={type(group.optimizer.optimizer).__name__} scheduler={sched} loss={type(group.loss_fn).__name__} "
            f"gradient_accumulation_steps={group.gradient_accumulation_steps}"
        )

    # ----------------------------------------------------------------- checkpoints
    def _trainer_state(self, group: OptimizerGroup, consumed_train_samples: int) -> dict[str, Any]:
        return {
            **group.state_dict(),
            "consumed_train_samples": consumed_train_samples,
            "world_size": self.runtime.world_size,
            "mesh": [self.runtime.mesh.dp_size, self.runtime.mesh.fsdp_size],
            "model_path": str(self.model_path),
            "base_model": self.model_id or "bundled:SmolLM2-135M-Instruct",
            "base_dtype": str(next(p.dtype for p in self.model.parameters() if not p.requires_grad)),
            "lora": lora_signature(self.model.peft_config[group.adapter_name]),
        }

    def save(
        self,
        name: str,
        output_dir: str = "output",
        adapter_name: str | None = None,
        save_optimizer: bool = True,
        consumed_train_samples: int = 0,
        save_total_limit: int | None = None,
        metric: float | None = None,
        keep: Sequence[str] = (),
    ) -> Path:
        """Write ``output_dir/name`` completely under a temporary name, then rename it into place.

        ``metric`` (an eval loss, lower is better) is stored with the checkpoint. With
        ``save_total_limit``, the oldest complete ``checkpoint-*`` folders beyond it are then
        deleted, except the newest, the one with the lowest stored metric and those in ``keep``
        (``twinkle.checkpoint.rotate_checkpoints``)."""
        group = self._group(adapter_name)
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
            grads = {n: local_grad(p) for n, p in self.model.named_parameters() if p.grad is not None}
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
        )
        logger.info(f"saved checkpoint {path}")
        if save_total_limit is not None and self.runtime.rank == 0:
            for deleted in rotate_checkpoints(out, save_total_limit, keep=keep):
                logger.info(f"deleted checkpoint {deleted} (save_total_limit={save_total_limit})")
        return path

    def resume_from_checkpoint(
        self, checkpoint_dir: str, resume_only_model: bool = False, adapter_name: str | None = None
    ) -> dict[str, int]:
        group = self._group(adapter_name)
        folder = Path(checkpoint_dir).expanduser()
        state = read_trainer_state(folder)
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
            params = dict(self.model.named_parameters())
            for n, g in window["grads"].items():
                restore_grad(params[n], g)
        if group.optimizer is not None:
            group.optimizer.sync_copies()
        group.resumed_samples, group.local_samples = int(state["consumed_train_samples"]), 0
        logger.info(f"resumed from {folder} at step {group.cur_step}")
        return {"consumed_train_samples": int(state["consumed_train_samples"]), "cur_step": group.cur_step}
