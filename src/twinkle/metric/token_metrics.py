"""``TokenMetrics``: loss, accuracy and throughput accumulated between two reads."""

import time

from twinkle.distributed.collectives import all_reduce_sum


class TokenMetrics:
    """Sums over the micro-batches since the last ``compute()``; ``compute`` reduces them over
    all ranks, so every rank returns the same numbers, and starts a new window."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.loss_sum = 0.0
        self.tokens = 0  # supervised tokens
        self.correct = 0
        self.input_tokens = 0  # non-pad tokens read by the model
        self.samples = 0
        self.batches = 0
        self.started: float | None = None  # the clock starts at the first batch, not at set-up

    def start_batch(self) -> None:
        if self.started is None:
            self.started = time.perf_counter()

    def restart_if_empty(self) -> None:
        """Nothing recorded since the clock started: start it again at the next batch. Training
        calls it on the evaluation window, so a reference pass of a training step (DPO's
        ``forward_only``) does not start the next evaluation's clock."""
        if self.batches == 0:
            self.started = None

    def update(self, loss_sum: float, tokens: int, correct: int, input_tokens: int, samples: int) -> None:
        self.loss_sum += loss_sum
        self.tokens += tokens
        self.correct += correct
        self.input_tokens += input_tokens
        self.samples += samples
        self.batches += 1

    def compute(self) -> dict[str, float]:
        now = time.perf_counter()
        elapsed = max(now - (now if self.started is None else self.started), 1e-9)
        loss_sum, tokens, correct, input_tokens, samples = all_reduce_sum(
            [self.loss_sum, self.tokens, self.correct, self.input_tokens, self.samples]
        )
        out = {
            "loss": loss_sum / tokens if tokens else float("nan"),
            "accuracy": correct / tokens if tokens else float("nan"),
            "supervised_tokens": int(tokens),
            "tokens": int(input_tokens),
            "samples": int(samples),
            "tokens_per_second": input_tokens / elapsed,
        }
        self.reset()
        return out
