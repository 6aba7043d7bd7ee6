"""A run's record: ``<output_dir>/metrics.jsonl``, ``--report-to`` sinks, progress, the end-of-run
summary and ``curves.png``.

The model calls three hooks, so a script needs no line of its own: ``on_backward`` after each
micro-batch (the progress), ``on_save`` after each checkpoint (where the summary finds the best
eval's weights) and ``on_metrics`` from every ``calculate_metric`` (one JSON line
per call: ``kind`` train or eval, ``adapter`` (the adapter the numbers are of), ``step``
(micro-batches, that adapter's ``cur_step``), ``time``
(Unix seconds), ``elapsed_s``, the metric numbers with lr, grad_norm and tokens_per_second, and
``peak_memory_mb``: ``torch.cuda.max_memory_allocated`` on CUDA, the process's peak RSS
elsewhere). Only rank 0 records, and only in a run whose configuration names sinks
(``RunDefaults.report_to`` is a tuple: a parsed command line's, or a script's
``initialize(run=...)``): a library call writes nothing.

A resumed run appends to the file; its steps continue, as the step counter is restored. A fresh
run starts the file again. Each line is flushed when written, so a crashed run keeps its
record. The end of the run is the process's exit (``atexit``, which also runs after an uncaught
exception or a preemption's ``SystemExit``): the sinks are closed, the summary line is logged
and ``curves.png`` is drawn from the file.

No run file is written through a link: ``check_run_files`` refuses, before training, a run file
or sink folder in the output dir that is a symbolic link (or a run file with other hard links,
or one that is not a regular file), and the writers open their files with ``O_NOFOLLOW``."""

import atexit
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from twinkle.checkpoint.layout import LAST, parse_trainer_state
from twinkle.metric.curves import draw_curves
from twinkle.metric.progress import Progress, _clock
from twinkle.metric.sinks import SINK_FOLDERS, open_sinks
from twinkle.runtime import RunDefaults, get_runtime
from twinkle.runtime.output_lock import LOCK_FILE
from twinkle.utils.errors import UserError
from twinkle.utils.fileio import is_complete, open_no_follow, refuse_link_message
from twinkle.utils.logger import get_logger

JSONL = "metrics.jsonl"
CURVES = "curves.png"
RUN_ARGS = "run_args.json"  # the parsed command line; ``twinkle eval`` reads the template from it
# What a run writes directly in its output dir, besides checkpoint folders.
RUN_FILES = (JSONL, RUN_ARGS, CURVES, LOCK_FILE)
logger = get_logger()


def check_run_files(output_dir: str | os.PathLike) -> None:
    """Refuse, before training, an output dir where a run file or a sink's folder is a symbolic
    link, or a run file has other hard links: writing it would change a file outside the folder.
    The writers open these files without following links too (``open_no_follow``), so a link
    made during the run is refused rather than written through."""
    folder = Path(output_dir).expanduser()
    for name in (*RUN_FILES, *SINK_FOLDERS):
        path = folder / name
        if path.is_symlink():
            raise UserError(f"--output-dir {output_dir}: " + refuse_link_message(path, "--output-dir"))
        if name in RUN_FILES and path.exists() and not path.is_file():
            raise UserError(
                f"--output-dir {output_dir}: {path} is not a regular file, and Twinkle writes its "
                "run record there; remove it or choose another --output-dir"
            )
        if name in RUN_FILES and path.is_file() and path.stat().st_nlink > 1:
            raise UserError(
                f"--output-dir {output_dir}: {path} has other hard links, so writing it would change "
                "them too; remove it or choose another --output-dir"
            )


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    from twinkle.utils.memory import peak_rss_mib

    return peak_rss_mib()


def _number(value: Any) -> float | int | None:
    """A JSON-safe number (NaN and inf become null), or None for what is not a number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value if isinstance(value, int) or math.isfinite(value) else None


def holds_step(folder: Path, step: int) -> bool:
    """``folder`` is a complete checkpoint saved at ``step`` (a later save under its name, as
    ``last-checkpoint`` gets, holds other weights)."""
    try:
        return is_complete(folder) and parse_trainer_state(folder)["cur_step"] == step
    except UserError:  # an unreadable trainer state: it names no step
        return False


def checkpoint_of(output_dir: Path, step: int) -> Path | None:
    """The saved checkpoint under ``output_dir`` that holds ``step``'s weights: ``checkpoint-<step>``,
    else ``last-checkpoint`` saved at that step (a run whose best eval is its last step), else None."""
    folder = output_dir / f"checkpoint-{step}"
    if folder.is_dir():
        return folder
    last = output_dir / LAST
    return last if holds_step(last, step) else None


class RunReport:
    """The record of one run on rank 0; files are opened at the first metric record."""

    def __init__(self, defaults: RunDefaults, device: torch.device):
        self.defaults = defaults
        self.device = device
        self.output_dir = Path(defaults.output_dir).expanduser()
        self.progress = Progress(logger)
        self.file: Any = None
        self.sinks: list[Any] = []
        self.started = time.time()
        self.first_step_time: float | None = None
        self.steps = 0
        self.train_tokens = 0
        self.best: dict[str, tuple[float, int]] = {}  # adapter -> (lowest eval loss, its step)
        self.saved: dict[tuple[str, int], list[Path]] = {}  # (adapter, step) -> folders saved then
        self.finished = False
        atexit.register(self.finish)

    def _open(self) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.file = open_no_follow(self.output_dir / JSONL, "a" if self.defaults.resuming else "w")
        config = dict(self.defaults.run_args or {})
        if config:
            with open_no_follow(self.output_dir / RUN_ARGS) as handle:
                handle.write(json.dumps(config, indent=2, default=str))
        self.sinks = open_sinks(self.defaults.report_to or (), self.output_dir, config)

    def on_backward(self, cur_step: int, total: int | None) -> None:
        if self.first_step_time is None:
            self.first_step_time = time.time()
        self.steps = cur_step
        self.progress.step(cur_step, total)

    def on_metrics(
        self, metrics: dict[str, Any], is_training: bool, cur_step: int, adapter: str = "default"
    ) -> None:
        if self.finished:
            return
        if self.file is None:
            self._open()
        kind = "train" if is_training else "eval"
        numbers = {k: v for k, v in ((k, _number(v)) for k, v in metrics.items()) if v is not None}
        numbers.pop("step", None)
        numbers["peak_memory_mb"] = round(peak_memory_mb(self.device), 1)
        record = {"kind": kind, "adapter": adapter, "step": cur_step, "time": round(time.time(), 3)}
        record["elapsed_s"] = round(time.time() - self.started, 3)
        self.file.write(json.dumps({**record, **numbers}) + "\n")
        self.file.flush()
        tag = kind if adapter == "default" else f"{adapter}/{kind}"  # several adapters: a chart each
        for sink in self.sinks:
            sink.log(tag, cur_step, numbers)
        if is_training:
            self.train_tokens += int(numbers.get("tokens", 0))
            self.progress.metrics(numbers)
        elif "loss" in numbers and (adapter not in self.best or numbers["loss"] < self.best[adapter][0]):
            self.best[adapter] = (float(numbers["loss"]), cur_step)

    def on_save(self, folder: str | os.PathLike, cur_step: int, adapter: str = "default") -> None:
        if not self.finished:
            self.saved.setdefault((adapter, cur_step), []).append(Path(folder))

    def _checkpoint(self, adapter: str, step: int) -> Path | None:
        """Where ``adapter``'s weights of ``step`` are: the first folder this run saved them to that
        still holds them (a ``checkpoint-N`` before a ``last-checkpoint``); for the one adapter of
        a run, also a folder of an earlier process of the run under the output dir."""
        for folder in self.saved.get((adapter, step), []):
            if holds_step(folder, step):
                return folder
        return checkpoint_of(self.output_dir, step) if len(self.best) == 1 else None

    def _best_text(self) -> str:
        """``best eval loss L at step N (folder)``; with several adapters, that of each."""
        texts = []
        for adapter, (loss, step) in self.best.items():
            folder = self._checkpoint(adapter, step)
            where = str(folder) if folder is not None else "no checkpoint saved at that step"
            name = "" if len(self.best) == 1 else f"{adapter} "
            texts.append(f"{name}{loss:.4f} at step {step} ({where})")
        return "best eval loss " + " and ".join(texts)

    def summary(self) -> str:
        wall = time.time() - self.started
        train_s = time.time() - (self.first_step_time or self.started)
        parts = [
            f"wall {_clock(wall)}",
            f"{self.steps} steps",
            f"{self.train_tokens / max(train_s, 1e-9):,.0f} tokens/s",
        ]
        parts.append(f"peak memory {peak_memory_mb(self.device):,.0f} MiB")
        if self.best:
            parts.append(self._best_text())
        return "run summary: " + ", ".join(parts)

    def finish(self) -> None:
        """Close the sinks and the file, log the summary, draw the curves. Safe to call twice."""
        if self.finished:
            return
        self.finished = True
        self.progress.close()
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:  # noqa: BLE001 - a sink's failure must not hide the summary
                logger.warning(f"closing {type(sink).__name__} failed: {exc}")
        if self.file is None:
            return
        self.file.close()
        try:
            png = draw_curves(self.output_dir / JSONL, self.output_dir / CURVES)
        except Exception as exc:  # noqa: BLE001 - the run's record stays in the JSONL
            logger.warning(f"drawing {self.output_dir / CURVES} failed: {exc}")
            png = None
        tail = f"; metrics in {self.output_dir / JSONL}" + (f", curves in {png}" if png else "")
        logger.info(self.summary() + tail)


def current(runtime: Any) -> RunReport | None:
    """This run's report on rank 0 of a CLI-parsed run (kept on its runtime), else None."""
    defaults = runtime.defaults
    if defaults.report_to is None or not runtime.is_main:
        return None
    if runtime.report is None:
        runtime.report = RunReport(defaults, runtime.device)
    return runtime.report


def on_backward(runtime: Any, group: Any) -> None:
    report = current(runtime)
    if report is not None:
        report.on_backward(group.cur_step, group.num_training_steps)


def on_metrics(runtime: Any, group: Any, metrics: dict[str, Any], is_training: bool) -> None:
    report = current(runtime)
    if report is not None:
        report.on_metrics(metrics, is_training, group.cur_step, group.adapter_name)


def on_save(runtime: Any, group: Any, folder: str | os.PathLike) -> None:
    report = current(runtime)
    if report is not None:
        report.on_save(folder, group.cur_step, group.adapter_name)


def finish(runtime: Any = None) -> None:
    """End the run's report now (the process's exit does it otherwise); ``runtime``: the run's,
    default the one ``initialize`` set up."""
    runtime = runtime or get_runtime()
    if runtime.report is not None:
        runtime.report.finish()
