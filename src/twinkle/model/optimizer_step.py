"""The optimizer half of ``TransformersModel``'s step API, mixed into it (as ``InputsAPI`` and
``MetricsAPI`` are): the accumulation window's reduction over ranks, clipping, the optimizer
step with its NaN/inf guard, the schedule's step and closing the window.

The model provides ``_group``, ``runtime``; the group (``OptimizerGroup``) holds the window."""

import math
from typing import Any

from twinkle.distributed.collectives import all_reduce_sum
from twinkle.model import health
from twinkle.model.checkpoints import save_and_exit
from twinkle.model.optim_setup import set_window
from twinkle.model.step import clip_gradients
from twinkle.model.train_state import OptimizerGroup
from twinkle.runtime import preemption
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

logger = get_logger()


def _clip(optimizer: Any, max_norm: float, norm_type: float = 2) -> float:
    """Clip ``optimizer``'s gradients to ``max_norm`` (0: measure only); the norm before. An
    optimizer whose gradients are of several kinds (expert blocks beside FSDP2's shards,
    ``twinkle.model.expert_parallel_full``) computes the norm itself (its ``clip``)."""
    own = getattr(optimizer, "clip", None)
    if own is not None:
        return own(max_norm, norm_type)
    return clip_gradients(optimizer.copies, max_norm if max_norm > 0 else math.inf, norm_type)


class OptimizerStepAPI:
    def _reduce_window(self, group: OptimizerGroup) -> tuple[float, float, float]:
        """Once per window: ``(supervised tokens, NaN/inf seen, SIGTERM seen)`` over all ranks, and
        the gradients rescaled to the mean over every supervised token of the window on all ranks
        (they are per-rank sums; FSDP averages them over the ranks). A SIGTERM on any rank rides
        along, so every rank saves the same step."""
        if group.optimizer is None:
            raise UserError("call set_optimizer(...) before the optimizer step")
        if group.reduced is None:
            total, nonfinite, preempted = all_reduce_sum(
                [group.window_tokens, float(group.window_nonfinite), float(preemption.requested())]
            )
            if total:
                group.optimizer.gather_grads(scale=self.runtime.world_size / total)
            group.reduced = (total, nonfinite, preempted)
        return group.reduced

    def clip_grad_norm(
        self, max_grad_norm: float | None = None, norm_type: float = 2, adapter_name: str | None = None
    ) -> float:
        """Clip the window's gradients (their global ``norm_type`` norm, after the rescale to the
        token mean) to ``max_grad_norm`` (default: ``--max-grad-norm``, 1.0; 0 measures without
        clipping); returns the norm before clipping, which ``step`` reports as ``grad_norm``."""
        group = self._group(adapter_name)
        if max_grad_norm is None:
            max_grad_norm = group.max_grad_norm
        if max_grad_norm is None:
            max_grad_norm = self.runtime.defaults.max_grad_norm
        total, _, _ = self._reduce_window(group)
        if total == 0:
            return 0.0
        group.window_grad_norm = _clip(group.optimizer, max_grad_norm, norm_type)
        return group.window_grad_norm

    def step(self, max_nonfinite_steps: int = 5, adapter_name: str | None = None) -> bool:
        """The optimizer step on the window's gradients (rescaled, clipped if ``clip_grad_norm``
        ran); returns whether it stepped. ``zero_grad()`` closes the window.

        The step is skipped when the window has no supervised token on any rank, or a NaN/inf
        loss or gradient (counted in the ``nonfinite_steps`` metric); ``max_nonfinite_steps`` such
        windows in a row stop training, and so does such a window at the end of the data, or a
        run without any supervised token (``twinkle.model.health``)."""
        group = self._group(adapter_name)
        total, nonfinite, _ = self._reduce_window(group)
        if total == 0:
            group.skipped_without_tokens()
            logger.warning("no supervised token in this accumulation window; the optimizer step is skipped")
            health.check_window_without_tokens(group)
            return False
        norm = group.window_grad_norm
        if norm is None:  # clip_grad_norm did not run: measure only, without clipping
            norm = _clip(group.optimizer, 0.0)
        if nonfinite or not math.isfinite(norm):
            self._drop_nonfinite_window(group, max_nonfinite_steps)
            return False
        lr = group.optimizer.param_groups[0]["lr"]
        group.optimizer.step()
        group.stepped(norm, lr)
        return True

    def zero_grad(self, adapter_name: str | None = None) -> None:
        """Drop the gradients and close the accumulation window. After a SIGTERM, this is the step
        boundary where the run saves and exits (``twinkle.runtime.preemption``)."""
        group = self._group(adapter_name)
        preempted = group.reduced is not None and group.reduced[2]
        if group.optimizer is not None:
            group.optimizer.zero_grad(set_to_none=True)
        group.close_window()
        if preempted:
            save_and_exit(self, group)

    def lr_step(self, adapter_name: str | None = None) -> None:
        """Advance the learning-rate schedule by one optimizer step."""
        group = self._group(adapter_name)
        if group.lr_scheduler is None:
            raise UserError("call set_lr_scheduler(...) before lr_step()")
        group.lr_scheduler.step()

    def clip_grad_and_step(
        self,
        max_grad_norm: float | None = None,
        norm_type: float = 2,
        max_nonfinite_steps: int = 5,
        adapter_name: str | None = None,
        gradient_accumulation_steps: int | None = None,
    ) -> bool:
        """Once the accumulation window is full: ``clip_grad_norm``, ``step``, ``lr_step`` (when it
        stepped and a schedule is set) and ``zero_grad``; returns whether it stepped. Before
        that, returns False and leaves the window open. ``max_grad_norm``/``norm_type`` and
        ``max_nonfinite_steps`` go to ``clip_grad_norm`` and ``step``. ``gradient_accumulation_steps``
        (upstream's per-call keyword) sets the adapter's window length (``optim_setup.set_window``)."""
        group = self._group(adapter_name)
        if group.optimizer is None:
            raise UserError("call set_optimizer(...) before clip_grad_and_step()")
        set_window(group, gradient_accumulation_steps)
        if not group.window_is_full():
            return False
        name = group.adapter_name
        self.clip_grad_norm(max_grad_norm, norm_type, adapter_name=name)
        stepped = self.step(max_nonfinite_steps, adapter_name=name)
        if stepped and group.lr_scheduler is not None:
            self.lr_step(adapter_name=name)
        self.zero_grad(adapter_name=name)
        return stepped

    def _drop_nonfinite_window(self, group: OptimizerGroup, limit: int) -> None:
        group.skipped_nonfinite()
        logger.warning(
            f"NaN/inf loss or gradient at step {group.cur_step}: update skipped "
            f"({group.consecutive_nonfinite} in a row, {group.nonfinite_steps} in all)"
        )
        if group.consecutive_nonfinite >= limit:
            raise UserError(
                f"training diverged: {limit} optimizer steps in a row had a NaN/inf loss or gradient "
                f"(last at step {group.cur_step}); lower --lr, check the data, or resume from an earlier checkpoint"
            )
        health.check_last_window_finite(group)
