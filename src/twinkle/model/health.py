"""Runs that learn nothing stop with one ``UserError`` line instead of exiting 0 with a useless
checkpoint.

* No supervised token: a single window without one can be legitimate (every row of one batch
  truncated away), a run without any cannot. Training stops when no window of the run has had a
  supervised token after ``NO_TOKEN_WINDOWS`` windows, or at the last window of the data
  (``set_lr_scheduler`` gave the horizon), whichever comes first. A resumed run that stepped
  before counts those steps.
* A non-finite eval loss: the weights give NaN/inf on the eval rows (training diverged), or the
  eval rows hold no supervised token, so the eval measured nothing.
* A non-finite last window: ``clip_grad_and_step`` skips a window whose loss or gradient is NaN/inf
  and stops after several in a row; when the data ends on such a window, the weights the run would
  save gave NaN/inf on its last batch, so the run stops there too."""

import math
from typing import Any

from twinkle.model.train_state import OptimizerGroup
from twinkle.utils.errors import UserError

NO_TOKEN_WINDOWS = 8  # windows in a row, from the start of the run, without a supervised token


def at_end_of_data(group: OptimizerGroup) -> bool:
    """The window just closed is the last of the data (known only from ``set_lr_scheduler``)."""
    return group.num_training_steps is not None and group.cur_step >= group.num_training_steps


def check_window_without_tokens(group: OptimizerGroup) -> None:
    """Called for each window with no supervised token on any rank (after ``skipped_steps`` counts it)."""
    if group.optimizer_steps or group.nonfinite_steps:  # some window of the run had tokens
        return
    if group.skipped_steps < NO_TOKEN_WINDOWS and not at_end_of_data(group):
        return
    raise UserError(
        f"no supervised token in any of the {group.skipped_steps} optimizer step(s) of this run "
        f"(up to step {group.cur_step}): the responses were truncated away or are empty, so nothing "
        "is learned; raise --max-length, use --truncation-strategy right, or check the dataset's responses"
    )


def check_last_window_finite(group: OptimizerGroup) -> None:
    """Called for a window whose loss or gradient was NaN/inf (it was skipped)."""
    if at_end_of_data(group):
        raise UserError(
            f"training diverged: the last step (step {group.cur_step}) had a NaN/inf loss or gradient, "
            f"so the weights this run would save give NaN/inf; {_advice(group)}"
        )


def count_metric(loss_fn: Any) -> str:
    """The name ``calculate_metric`` gives the loss's count: supervised tokens, or the loss's own
    unit (``pairs`` for the preference losses, ``completions`` for GRPO's per-completion mean)."""
    return getattr(loss_fn, "count_metric", "supervised_tokens")


def check_eval(group: OptimizerGroup, metrics: dict[str, Any]) -> None:
    """Called with the eval numbers of ``calculate_metric(is_training=False)``."""
    loss = metrics.get("loss")
    if not metrics.get("samples") or not isinstance(loss, float) or math.isfinite(loss):
        return  # no eval batch since the last call, or a finite loss
    if not metrics.get(count_metric(group.loss_fn)):
        raise UserError(
            f"the eval at step {group.cur_step} saw no supervised token in {metrics['samples']} rows, so its "
            "loss is undefined; raise --max-length, use --truncation-strategy right, or check the eval rows"
        )
    if group.cur_step == 0:  # evaluating a saved adapter, not a run of this process
        raise UserError(
            f"eval loss is {loss}: this adapter's weights give a NaN/inf loss (its training diverged); "
            "evaluate an earlier checkpoint"
        )
    raise UserError(f"eval loss is {loss} at step {group.cur_step}: training diverged; {_advice(group)}")


def _advice(group: OptimizerGroup) -> str:
    lr = group.last_lr
    if group.optimizer is not None:  # the set value, not the schedule's current one
        lr = group.optimizer.param_groups[0].get("initial_lr", group.optimizer.param_groups[0]["lr"])
    given = f" (it is {lr:g})" if isinstance(lr, float) and math.isfinite(lr) else ""
    return f"lower --lr{given}, check the data, or resume from an earlier checkpoint"
