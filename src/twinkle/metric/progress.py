"""Training progress on rank 0: a tqdm bar on a terminal, plain text elsewhere.

On a terminal (stderr is a tty) a bar over the training steps (micro-batches, the script's
``cur_step``) shows the ETA, tokens/s and the last logged loss; Twinkle's log lines are printed
above it (``tqdm.write``) so they do not tear it. A script's own ``tqdm`` (the contract's eval
loop) takes the next free line below it, as tqdm places nested bars, and leaves its finished
line in the scrollback.

Elsewhere (CI, ``| tee``) there is no bar: the progress rides on the line the script logs after
each training ``calculate_metric`` (the contract's one line per ``--log-interval``), as a
``| progress ...`` suffix, so each interval still prints exactly one line. A script that logs
nothing after its metric call gets a line of its own per call instead."""

import logging
import sys
import time
from typing import Any


def _clock(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Fed by ``step(cur_step, total)`` once per micro-batch and ``metrics(numbers)`` once per
    training metric record; ``close()`` ends the bar or the log hook."""

    def __init__(self, logger: logging.Logger, stream: Any = None):
        self.logger = logger
        self.stream = sys.stderr if stream is None else stream
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.bar: Any = None
        self.redirect: Any = None
        self.total: int | None = None
        self.step_now = 0
        self.first: tuple[float, int] | None = None  # (time, step) of this process's first step
        self.pending: str | None = None  # the suffix waiting for the script's log line
        self.numbers: dict[str, float] = {}
        if not self.tty:
            logger.addFilter(self._add_suffix)

    def step(self, cur_step: int, total: int | None) -> None:
        self.step_now, self.total = cur_step, total
        if self.first is None:
            self.first = (time.perf_counter(), cur_step - 1)
        if not self.tty:
            return
        if self.bar is None:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self.bar = tqdm(
                total=total,
                initial=cur_step - 1,
                desc="train",
                unit="step",
                file=self.stream,
                dynamic_ncols=True,
            )
            self.redirect = logging_redirect_tqdm(loggers=[self.logger])
            self.redirect.__enter__()
        self.bar.update(cur_step - self.bar.n)

    def eta(self) -> float | None:
        if self.first is None or self.total is None:
            return None
        started, step0 = self.first
        done = self.step_now - step0
        return (time.perf_counter() - started) / max(1, done) * max(0, self.total - self.step_now)

    def describe(self) -> str:
        total = f"/{self.total} ({100 * self.step_now / max(1, self.total):.0f}%)" if self.total else ""
        eta = self.eta()
        parts = [f"step {self.step_now}{total}", f"eta {_clock(eta) if eta is not None else '?'}"]
        if "tokens_per_second" in self.numbers:
            parts.append(f"{self.numbers['tokens_per_second']:,.0f} tokens/s")
        if "loss" in self.numbers:
            parts.append(f"loss {self.numbers['loss']:.4f}")
        return ", ".join(parts)

    def metrics(self, numbers: dict[str, float]) -> None:
        self.numbers = numbers
        if self.tty:
            if self.bar is not None:
                postfix = {"loss": f"{numbers.get('loss', float('nan')):.4f}"}
                if "tokens_per_second" in numbers:
                    postfix["tok/s"] = f"{numbers['tokens_per_second']:,.0f}"
                self.bar.set_postfix(postfix)
            return
        if self.pending is not None:  # the script logged nothing after the last metric call
            text, self.pending = self.pending, None
            self.logger.info(f"progress: {text}")
        self.pending = self.describe()

    def _add_suffix(self, record: logging.LogRecord) -> bool:
        if self.pending is not None and record.levelno == logging.INFO:
            text, self.pending = self.pending, None
            record.msg = f"{record.getMessage()} | progress: {text}"
            record.args = None
        return True

    def close(self) -> None:
        if self.pending is not None:
            text, self.pending = self.pending, None
            self.logger.info(f"progress: {text}")
        self.logger.removeFilter(self._add_suffix)
        if self.bar is not None:
            self.bar.close()
            self.redirect.__exit__(None, None, None)
            self.bar = None
