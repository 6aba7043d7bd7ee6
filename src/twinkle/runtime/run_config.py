"""``RunDefaults``: a run's configuration, the values a component uses where a call leaves one out.

Where it comes from: the CLI (``twinkle.cli``) parses the command line into one and hands it over
(``hand_over``), which changes nothing in the process; ``twinkle.initialize()`` takes it (or
the one passed as ``initialize(run=...)``), applies its process-wide effects and keeps it in the
``Runtime`` it creates (``Runtime.defaults``). Components read it when they are built, through
``run_defaults()``: without a runtime they get the dataclass's defaults. An explicit argument
always wins, so a script that never parses a command line gets the same run by passing the
same values to ``initialize(run=RunDefaults(...))`` or to the components."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_SEED = 42


@dataclass(frozen=True)
class RunDefaults:
    seed: int = DEFAULT_SEED
    process_group_timeout_s: int = 600  # how long a collective waits for a dead peer
    dtype: str = "auto"  # the weights' dtype: auto (bf16 on accelerators, fp32 on CPU), float32, bfloat16
    activation_checkpointing: str = "auto"  # auto, on, off
    strategy: str = "fsdp"  # how several processes hold the model: fsdp or ddp
    output_dir: str = "output"  # where a preempted run saves its checkpoint and metrics.jsonl goes
    # the run owns output_dir: initialize() locks it for the run's life (``output_lock``); a
    # library call that only builds a model owns no folder
    lock_output_dir: bool = False
    max_restarts: int = 0  # Ray: relaunches after a worker dies
    ray_address: str | None = None  # Ray: the cluster to join; None: $RAY_ADDRESS, else a local one
    ray_placement: str = "pack"  # Ray: "pack" or "spread" the workers over the nodes
    max_grad_norm: float = 1.0  # clip_grad_and_step's gradient-norm bound when the call gives none
    model_cls: str | None = None  # the transformers class to load; None: AutoModelForCausalLM
    skip_bad_rows: bool = False  # Dataset(): drop rows that cannot be used instead of stopping
    # the run records its metrics (``twinkle.metric.report``): the sinks, () for the JSONL alone;
    # None records nothing
    report_to: tuple[str, ...] | None = None
    resuming: bool = False  # the run resumes a checkpoint: its metrics.jsonl is appended to
    run_args: dict | None = None  # the parsed command line, saved next to the metrics


@dataclass(frozen=True)
class HandedOver:
    """What the command line asks of the run, waiting for ``initialize()``: its configuration
    and, for a script run by a person, the hook that prints a ``UserError`` as one line."""

    defaults: RunDefaults
    excepthook: Callable[..., Any] | None = None


_handed_over: list[HandedOver] = []  # at most one: the last command line parsed, until initialize()


def hand_over(defaults: RunDefaults, excepthook: Callable[..., Any] | None = None) -> None:
    """Leave a parsed command line's configuration for the next ``initialize()``; nothing in the
    process changes until then."""
    _handed_over[:] = [HandedOver(defaults, excepthook)]


def take_handed_over() -> HandedOver | None:
    """The configuration ``hand_over`` left, once (``initialize`` calls this)."""
    return _handed_over.pop() if _handed_over else None
