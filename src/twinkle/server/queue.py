"""``Queue``: the model's work, run by one worker thread, fairly and in bounded slices.

Two lanes, ``train`` (creating runs, forward/backward, optimizer steps, saves, loads) and
``sample``. The worker takes the lanes in turn whenever both have work, so a training step runs
between any two slices of sampling; within a lane it takes the tenants in turn (round robin over
those with work waiting), each tenant's requests in the order they came.

A job is a function run on the worker. One that returns a generator runs in slices: each
``next()`` is one slice (``ModelCore.sample_steps`` decodes a chunk of the model's shared
decoding batch for about the sampling route's ``SLICE_SECONDS`` and pauses), after which the job
goes back to its tenant's turn and others run. That is how one tenant's largest legal sample
shares the model with every other tenant's requests instead of holding it for minutes. A slice
may yield the seconds to charge the job for it (a batched sample: the decoding it took part in,
whichever job's slice ran it); else the slice's own time is charged. A sliced job charged
``max_seconds`` in all is stopped (its generator closed, so its clean-up runs) and fails with a
message saying so; a job that is not sliced runs whole (its size is bounded before it is queued).
At most ``max_started`` sliced jobs are under way at once (each holds an adapter slot while
paused); the others wait for their turn to start. Cancelling a paused sliced job stops it the
same way at its next turn.

Futures: a finished request's result is kept until ``keep_after_retrieval`` seconds after it was
first retrieved (a client whose answer was lost in transit asks again), or ``future_ttl`` seconds
after it finished if it is never retrieved; then it is dropped, so memory does not grow with the
number of requests. Each tenant may have at most ``max_queued`` requests waiting or running."""

import collections
import contextlib
import inspect
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from twinkle.server.errors import NotFound, TooMany

LANES = ("train", "sample")


class Future:
    def __init__(self, tenant: str, lane: str):
        self.tenant, self.lane = tenant, lane
        self.done = threading.Event()
        self.result: Any = None  # a JSON-able dict, or bytes of a protobuf message
        self.error: tuple[str, str] | None = None  # (message, "user" | "server")
        self.finished: float | None = None  # time.monotonic() when done
        self.retrieved: float | None = None  # time.monotonic() of its first retrieval when done
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []

    def finish(self) -> None:
        with self._lock:
            self.finished = time.monotonic()
            self.done.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            with contextlib.suppress(RuntimeError):  # the poll's event loop has closed
                callback()

    def on_done(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` (from the worker thread) when the request ends, or now if it has;
        returns a function that takes it back. A poll waits this way instead of waking every few
        milliseconds: many waiting polls would otherwise take the interpreter's lock from the
        worker thread, whose decoding is mostly Python between small tensor operations."""
        with self._lock:
            if not self.done.is_set():
                self._callbacks.append(callback)
                return lambda: self._forget(callback)
        callback()
        return lambda: None

    def _forget(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if callback in self._callbacks:
                self._callbacks.remove(callback)


class Job:
    def __init__(self, request_id: str | None, tenant: str, fn: Callable[[], Any], lane: str):
        self.request_id, self.tenant, self.fn, self.lane = request_id, tenant, fn, lane
        self.steps: Any = None  # the generator of a sliced job, once started
        self.ran = 0.0  # seconds charged to it (the worker's time, or what its slices yielded)
        self.cancelled = False  # a paused sliced job to stop at its next turn


class Queue:
    """See the module docstring. ``on_done(tenant, lane, seconds_waited_and_run, ok)``: called in
    the worker as each request ends (the server's metrics)."""

    def __init__(
        self,
        max_seconds: float = 0.0,
        future_ttl: float = 3600.0,
        keep_after_retrieval: float = 60.0,
        max_queued: int = 256,
        max_started: int = 1,
        on_done: Callable[[str, str, float, bool], None] | None = None,
    ):
        self.max_seconds, self.future_ttl = max_seconds, future_ttl
        self.keep_after_retrieval, self.max_queued = keep_after_retrieval, max_queued
        self.max_started, self.on_done = max(1, max_started), on_done
        self.lanes: dict[str, collections.OrderedDict[str, collections.deque]] = {
            lane: collections.OrderedDict() for lane in LANES
        }
        self.calls: collections.deque = collections.deque()  # ``call``: ahead of every request
        self.futures: dict[str, Future] = {}
        self.open: collections.Counter = collections.Counter()  # tenant -> requests not finished
        self.submitted: dict[str, float] = {}  # request id -> time.monotonic() when queued
        self.started: set[str] = set()  # sliced jobs under way
        self.running: Job | None = None  # the job whose slice the worker runs now
        self.cond = threading.Condition()
        self.stopped = False
        self.turn = 0  # the lane served last
        self.swept, self.sweep_every = time.monotonic(), 1.0
        self.step_times: collections.deque = collections.deque(maxlen=100)
        self.worker = threading.Thread(target=self._loop, name="twinkle-server-worker", daemon=True)
        self.worker.start()

    # ------------------------------------------------------------------ submitting
    def submit(self, tenant: str, fn: Callable[[], Any], lane: str = "train") -> str:
        """Queue ``fn`` for ``tenant``; its request id. ``TooMany`` (retry later) when the tenant
        already has ``max_queued`` requests waiting or running."""
        if lane not in LANES:
            raise ValueError(f"lane must be one of {LANES}, got {lane!r}")
        request_id = uuid.uuid4().hex
        with self.cond:
            mine = self.open[tenant]
            if mine >= self.max_queued:
                raise TooMany(
                    f"this key has {mine} requests waiting or running, the most the server queues for "
                    "one key; wait for some to finish",
                    retry_after=1.0,
                )
            self.futures[request_id] = Future(tenant, lane)
            self.submitted[request_id] = time.monotonic()
            self.open[tenant] += 1
            self.lanes[lane].setdefault(tenant, collections.deque()).append(Job(request_id, tenant, fn, lane))
            self.cond.notify()
        return request_id

    def call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` run on the worker thread, its result returned (its exception raised) here.
        The server builds its model this way: torch computing on a second thread after the first
        one has run parallel regions is measurably slower (each thread keeps its own
        OpenMP team), so every pass over the model runs on the worker."""
        done, out = threading.Event(), {}

        def job() -> None:
            try:
                out["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 (raised again in the caller's thread)
                out["error"] = exc
            finally:
                done.set()

        with self.cond:
            self.calls.append(job)
            self.cond.notify()
        done.wait()
        if "error" in out:
            raise out["error"]
        return out["value"]

    def cancel(self, tenant: str, request_id: str) -> bool:
        """Drop a request that has not started, or stop a sliced one under way before its next
        slice (its generator closed; a slice running now finishes first, and a request that ends
        in it keeps its result); its future fails as cancelled. False when it finished already or
        runs unsliced."""
        fut = self.future(tenant, request_id)
        with self.cond:
            running = self.running
            if running is not None and running.request_id == request_id:
                running.cancelled = running.steps is not None
                return running.cancelled
            jobs = self.lanes[fut.lane].get(tenant, ())
            for job in jobs:
                if job.request_id == request_id and job.steps is not None:
                    job.cancelled = True  # the worker closes it: its clean-up uses the model
                    return True
                if job.request_id == request_id:
                    jobs.remove(job)
                    if not jobs:
                        del self.lanes[fut.lane][tenant]
                    fut.error = ("the request was cancelled", "user")
                    self._settle(tenant, request_id)
                    fut.finish()
                    return True
        return False

    # ------------------------------------------------------------------ reading
    def depth(self, tenant: str | None = None, lane: str | None = None) -> int:
        """Requests waiting or paused between slices (of ``tenant``, or of all; in ``lane``, or in
        both)."""
        with self.cond:
            return sum(
                len(q)
                for name, jobs in self.lanes.items()
                if lane in (None, name)
                for t, q in jobs.items()
                if tenant in (None, t)
            )

    def future(self, tenant: str, request_id: str) -> Future:
        with self.cond:
            self._expire(time.monotonic())
            fut = self.futures.get(request_id)
        if fut is None or fut.tenant != tenant:
            raise NotFound(
                f"request_id {request_id!r} is not one of this key's requests, or its result expired "
                f"(kept {self.keep_after_retrieval:g} s after it is retrieved, {self.future_ttl:g} s if never)"
            )
        return fut

    def retrieved(self, fut: Future) -> None:
        """Note that a finished future's answer was sent (it expires ``keep_after_retrieval``
        seconds from its first retrieval)."""
        if fut.retrieved is None:
            fut.retrieved = time.monotonic()

    def _expire(self, now: float) -> None:
        """Drop finished futures past their time (under ``cond``; at most every ``sweep_every`` s)."""
        if now - self.swept < self.sweep_every:
            return
        self.swept = now
        gone = [
            rid
            for rid, f in self.futures.items()
            if f.finished is not None
            and (
                (f.retrieved is not None and now - f.retrieved >= self.keep_after_retrieval)
                or now - f.finished >= self.future_ttl
            )
        ]
        for rid in gone:
            del self.futures[rid]

    # ------------------------------------------------------------------ the worker
    def _next(self) -> Job | Callable | None:
        with self.cond:
            while not self.stopped and not self.calls and not self._ready():
                self.cond.wait(timeout=1.0)
                self._expire(time.monotonic())
            if self.stopped:
                return None
            if self.calls:
                return self.calls.popleft()
            for i in range(1, len(LANES) + 1):  # the lane after the one served last, if it has work
                lane = LANES[(self.turn + i) % len(LANES)]
                job = self._take(lane)
                if job is not None:
                    self.turn = LANES.index(lane)
                    return job
            raise AssertionError("a lane was ready but had no job to take")

    def _ready(self) -> bool:
        return any(self._startable(lane, t) for lane in LANES for t in self.lanes[lane])

    def _startable(self, lane: str, tenant: str) -> bool:
        """Whether the tenant's next job in ``lane`` may run now (a sliced job under way always
        may; a new one waits while ``max_started`` are under way, unless it turns out unsliced)."""
        job = self.lanes[lane][tenant][0]
        return lane != "sample" or job.steps is not None or len(self.started) < self.max_started

    def _take(self, lane: str) -> Job | None:
        """The next job of the first tenant in ``lane`` that can run; that tenant goes to the back."""
        for tenant in list(self.lanes[lane]):
            if self._startable(lane, tenant):
                jobs = self.lanes[lane].pop(tenant)
                job = jobs.popleft()
                if jobs:
                    self.lanes[lane][tenant] = jobs
                return job
        return None

    def _requeue(self, job: Job) -> None:
        """A paused sliced job: first in its tenant's line, the tenant last among the tenants (in
        the same hold of the lock that ends its slice, so ``cancel`` finds it in one place)."""
        with self.cond:
            self.running = None
            jobs = self.lanes[job.lane].pop(job.tenant, collections.deque())
            jobs.appendleft(job)
            self.lanes[job.lane][job.tenant] = jobs

    def _loop(self) -> None:
        while (job := self._next()) is not None:
            if not isinstance(job, Job):  # ``call``: the job reports its own outcome
                job()
                continue
            fut = self.futures[job.request_id]
            with self.cond:
                self.running = job
            start = time.perf_counter()
            charged = None
            try:
                finished, result = self._run(job)
                charged = None if finished else result
            except BaseException as exc:  # noqa: BLE001 (one tenant's failure fails its request only)
                finished, result = True, None
                fut.error = error_of(exc)
            job.ran += time.perf_counter() - start if charged is None else charged
            if not finished:
                self._requeue(job)
                continue
            with self.cond:
                self.running = None
            self.started.discard(job.request_id)
            if fut.error is None:
                fut.result = result
            self.step_times.append(job.ran)
            with self.cond:
                waited = time.monotonic() - self._settle(job.tenant, job.request_id)
            fut.finish()
            if self.on_done is not None:
                self.on_done(job.tenant, job.lane, waited, fut.error is None)

    def _settle(self, tenant: str, request_id: str) -> float:
        """A request leaves the tenant's line (under ``cond``); when it was queued."""
        self.open[tenant] -= 1
        if not self.open[tenant]:
            del self.open[tenant]
        return self.submitted.pop(request_id)

    def _run(self, job: Job) -> tuple[bool, Any]:
        """One slice of ``job`` (the whole of an unsliced one): (finished, its result), or (False,
        the seconds the slice yielded to be charged, None for its own time)."""
        if job.steps is None:
            out = job.fn()
            if not inspect.isgenerator(out):
                return True, out
            job.steps = out
            self.started.add(job.request_id)
        if job.cancelled:
            job.steps.close()
            raise Cancelled("the request was cancelled")
        if self.max_seconds and job.ran >= self.max_seconds:
            job.steps.close()
            raise TooLong(
                f"the request ran for {job.ran:.0f} s, past this server's limit of {self.max_seconds:g} s "
                "per request (--max-request-seconds); ask for fewer samples or tokens"
            )
        try:
            charged = next(job.steps)
        except StopIteration as end:
            return True, end.value
        return False, charged if isinstance(charged, float) else None

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()


class TooLong(Exception):
    """A sliced request stopped at the server's limit on one request's running time."""


class Cancelled(Exception):
    """A sliced request stopped because its tenant cancelled it."""


def error_of(exc: BaseException) -> tuple[str, str]:
    """(one-line message, "user" | "server") of a failed request."""
    from twinkle.utils.errors import UserError

    if isinstance(exc, (UserError, ValueError, TooLong, Cancelled)):
        text = str(exc)
        return (text.splitlines()[0] if text else type(exc).__name__, "user")
    message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
    return (message.splitlines()[0], "user" if hasattr(exc, "status") else "server")
