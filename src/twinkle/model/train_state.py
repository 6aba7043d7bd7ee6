"""``OptimizerGroup``: everything that trains one adapter (optimizer, schedule, loss, counters)."""

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from twinkle.metric import TokenMetrics


def stream_seed(seed: int, name: str, purpose: str, rank: int = 0) -> int:
    """A 63-bit seed from (run seed, adapter name, purpose, rank), the same in every process and
    Python version (a SHA-256 digest, not Python's salted ``hash``)."""
    digest = hashlib.sha256(f"{seed}\0{name}\0{purpose}\0{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass
class OptimizerGroup:
    """Per-adapter training state.

    ``cur_step`` counts micro-batches (the script keys its log/eval cadence off it);
    ``optimizer_steps`` counts optimizer updates, one per ``gradient_accumulation_steps``
    micro-batches. ``window_tokens`` is this rank's supervised-token count of the open
    accumulation window: the gradients are token sums (under FSDP, averaged over the ranks)
    until the step rescales them by the global count. Without a scheduler the horizon is
    unknown, so a last partial window is only stepped if ``set_lr_scheduler`` gave it."""

    adapter_name: str
    gradient_accumulation_steps: int = 1
    optimizer: Any = None
    lr_scheduler: Any = None
    loss_fn: Any = None
    num_training_steps: int | None = None  # horizon in micro-batches, as the script gives it
    cur_step: int = 0
    optimizer_steps: int = 0
    window_tokens: int = 0
    window_batches: int = 0
    skipped_steps: int = 0
    window_nonfinite: bool = False  # a NaN/inf loss was seen in the open window on this rank
    nonfinite_steps: int = 0
    consecutive_nonfinite: int = 0
    last_grad_norm: float = float("nan")
    last_lr: float = float("nan")
    # the clipping norm ``clip_grad_norm`` uses when the call gives none (upstream's 'default'
    # optimizer's ``clip_grad``); None: the run's ``--max-grad-norm``
    max_grad_norm: float | None = None
    # samples this rank trained on since the start or the resume, and the run's count before it
    # (the checkpoint's consumed_train_samples): what a preempted run's checkpoint records
    local_samples: int = 0
    resumed_samples: int = 0
    # the open window's (supervised tokens, NaN/inf seen, SIGTERM seen) over all ranks, once its
    # gradients are rescaled for the step; None until then (``TransformersModel._reduce_window``)
    reduced: tuple[float, float, float] | None = None
    # the open window's gradient norm before clipping, once ``clip_grad_norm`` measured it; the
    # step reuses it and, when it steps, makes it ``last_grad_norm``; None until then
    window_grad_norm: float | None = None
    train_metrics: TokenMetrics = field(default_factory=TokenMetrics)
    eval_metrics: TokenMetrics = field(default_factory=TokenMetrics)
    # what raw rows pass through before the step (``set_template``, ``set_processor``); None:
    # the default, built on first use
    template: Any = None
    processor: Any = None
    # metrics ``add_metric`` gave, by is_training, and the last recorded micro-batch of each kind,
    # accumulated once the step after it is known (``twinkle.model.metrics_api``)
    added_metrics: dict[bool, list[Any]] = field(default_factory=lambda: {True: [], False: []})
    pending_metric_batch: dict[bool, tuple[Any, Any]] = field(default_factory=dict)
    # the adapter's own torch RNG stream (CPU, and the accelerator's when there is one) while
    # another adapter is active: dropout masks draw from the global generator, so a model that
    # switches adapters keeps each adapter's draws apart (``swap_rng_out`` / ``swap_rng_in``)
    rng_cpu: torch.Tensor | None = None
    rng_device: torch.Tensor | None = None

    def swap_rng_out(self) -> None:
        """The adapter stops being active: keep the global generators' state as its stream."""
        self.rng_cpu = torch.get_rng_state()
        self.rng_device = torch.cuda.get_rng_state() if torch.cuda.is_available() else None

    def swap_rng_in(self, seed: int) -> None:
        """The adapter becomes active: the global generators continue its stream, seeded from
        ``seed`` on its first activation."""
        if self.rng_cpu is None:
            self.rng_cpu = torch.Generator().manual_seed(seed).get_state()
            if torch.cuda.is_available():
                self.rng_device = torch.Generator(device="cuda").manual_seed(seed).get_state()
        torch.set_rng_state(self.rng_cpu)
        if self.rng_device is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(self.rng_device)

    def window_is_full(self) -> bool:
        """Step after exactly ``gradient_accumulation_steps`` micro-batches, and at the end of the data."""
        at_end = self.num_training_steps is not None and self.cur_step == self.num_training_steps
        return self.window_batches >= self.gradient_accumulation_steps or (at_end and self.window_batches > 0)

    # The window's and the counters' transitions; the model's step calls run them in this order:
    # add_micro_batch per backward, then stepped / skipped_nonfinite / skipped_without_tokens, then
    # close_window (``TransformersModel``).
    def add_micro_batch(self, samples: int, tokens: int, finite: bool, counts: bool = True) -> None:
        """A micro-batch's gradients joined the open window (``cur_step`` counted before);
        ``counts=False``: a part of a batch that counts once, at its last part."""
        self.local_samples += samples
        self.window_batches += int(counts)
        self.window_tokens += tokens
        self.window_nonfinite = self.window_nonfinite or not finite

    def stepped(self, grad_norm: float, lr: float) -> None:
        """The optimizer stepped on the window, whose gradient norm was ``grad_norm``, at ``lr``."""
        self.last_grad_norm, self.last_lr = grad_norm, lr
        self.optimizer_steps += 1
        self.consecutive_nonfinite = 0

    def skipped_nonfinite(self) -> None:
        """The window held a NaN/inf loss or gradient: no step."""
        self.nonfinite_steps += 1
        self.consecutive_nonfinite += 1

    def skipped_without_tokens(self) -> None:
        """The window held no supervised token on any rank: no step."""
        self.skipped_steps += 1

    def close_window(self) -> None:
        """The next micro-batch opens a new window (its gradients are dropped by the caller)."""
        self.window_tokens = self.window_batches = 0
        self.window_nonfinite = False
        self.reduced = None
        self.window_grad_norm = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "adapter_name": self.adapter_name,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "cur_step": self.cur_step,
            "optimizer_steps": self.optimizer_steps,
            "window_tokens": self.window_tokens,
            "window_batches": self.window_batches,
            "skipped_steps": self.skipped_steps,
            "nonfinite_steps": self.nonfinite_steps,
            "last_grad_norm": self.last_grad_norm,
            "last_lr": self.last_lr,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in (
            "cur_step",
            "optimizer_steps",
            "window_tokens",
            "window_batches",
            "skipped_steps",
            "nonfinite_steps",
        ):
            setattr(self, key, int(state[key]))
        self.last_grad_norm = float(state["last_grad_norm"])
        self.last_lr = float(state["last_lr"])
