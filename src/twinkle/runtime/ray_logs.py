"""The workers' last lines reach the driver before the job ends.

Ray forwards a worker's stdout and stderr to the driver asynchronously (a monitor tails the
worker's log files and publishes batches), so a rank's last lines, its final eval loss among
them, can still be in flight when every ``run`` has returned and the driver stops the actors.
Each rank therefore ends both streams with an end line (``END``), and the driver waits, at most
``DRAIN_SECONDS``, until it has seen that line from every rank on both streams. The end lines are
taken out of the batches before Ray prints them. This hooks Ray's stream dispatcher, which is not a
public API: where a Ray version lacks it, the driver does not wait and the ranks write no end line.
"""

import sys
import threading
import time
from typing import Any

END = "[twinkle] end of rank output"
DRAIN_SECONDS = 10.0  # a stalled log monitor must not hold a finished job
ENV = "TWINKLE_RAY_LOG_END"  # set in a worker's environment when its driver waits for END


def _dispatcher() -> Any | None:
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return None
    if not all(hasattr(dispatcher, name) for name in ("handlers", "_lock", "remove_handler")):
        return None
    return dispatcher


def end_streams(rank: int) -> None:
    """Called by a rank as its script ends: flush both streams and mark their end."""
    for stream in (sys.stdout, sys.stderr):
        print(f"{END} {rank}", file=stream, flush=True)


class Drain:
    """Watches the forwarded batches for every rank's end lines; strips them before printing."""

    NAME = "twinkle_rank_end"

    def __init__(self, dispatcher: Any) -> None:
        self._dispatcher = dispatcher
        self._seen: set[tuple[int, bool]] = set()
        self._changed = threading.Condition()

    @classmethod
    def install(cls) -> "Drain | None":
        """A drain hooked in front of Ray's printing, or None where this Ray has no dispatcher."""
        dispatcher = _dispatcher()
        if dispatcher is None:
            return None
        drain = cls(dispatcher)
        with dispatcher._lock:  # first, so the end lines are gone before Ray prints the batch
            dispatcher.handlers = [(cls.NAME, drain.handle), *dispatcher.handlers]
        return drain

    def handle(self, data: dict) -> None:
        lines = data.get("lines") or []
        ends = [line for line in lines if line.startswith(END)]
        if not ends:
            return
        data["lines"] = [line for line in lines if not line.startswith(END)]
        with self._changed:
            for line in ends:
                rank = line[len(END) :].strip()
                if rank.isdigit():
                    self._seen.add((int(rank), bool(data.get("is_err"))))
            self._changed.notify_all()

    def reset(self) -> None:
        """Forget the ends seen (a restarted group writes them again)."""
        with self._changed:
            self._seen.clear()

    def wait(self, ranks: int, timeout: float = DRAIN_SECONDS) -> bool:
        """Whether both streams of ranks ``0..ranks-1`` ended within ``timeout`` seconds."""
        want = {(r, err) for r in range(ranks) for err in (False, True)}
        deadline = time.monotonic() + timeout
        with self._changed:
            while not want <= self._seen:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return True

    def remove(self) -> None:
        self._dispatcher.remove_handler(self.NAME)
