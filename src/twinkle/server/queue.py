"""``Queue``: one worker thread runs the requests one at a time, taking the tenants in turn (round
robin over those with work waiting), each tenant's requests in the order they came."""

import collections
import threading
import time
import uuid
from typing import Any

from twinkle.server.errors import NotFound


class Future:
    def __init__(self, tenant: str):
        self.tenant = tenant
        self.done = threading.Event()
        self.result: Any = None  # a JSON-able dict, or bytes of a protobuf message
        self.error: tuple[str, str] | None = None  # (message, "user" | "server")


class Queue:
    """Fair time-slicing of the model across tenants; see the module docstring."""

    def __init__(self):
        self.pending: dict[str, collections.deque] = collections.OrderedDict()
        self.futures: dict[str, Future] = {}
        self.cond = threading.Condition()
        self.stopped = False
        self.step_times: collections.deque = collections.deque(maxlen=100)
        self.worker = threading.Thread(target=self._loop, name="twinkle-server-worker", daemon=True)
        self.worker.start()

    def submit(self, tenant: str, fn: Any) -> str:
        request_id = uuid.uuid4().hex
        with self.cond:
            self.futures[request_id] = Future(tenant)
            self.pending.setdefault(tenant, collections.deque()).append((request_id, fn))
            self.cond.notify()
        return request_id

    def call(self, fn: Any) -> Any:
        """``fn()`` run on the worker thread, its result returned (its exception raised) here.
        The server builds its model this way: torch computing on a second thread after the first
        one has run parallel regions is about 25% slower on 2 cores (each thread keeps its own
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
            self.pending.setdefault("", collections.deque()).append((None, job))
            self.cond.notify()
        done.wait()
        if "error" in out:
            raise out["error"]
        return out["value"]

    def cancel(self, tenant: str, request_id: str) -> bool:
        """Drop a request that has not started (its future fails as cancelled); False when it
        started or finished already."""
        fut = self.future(tenant, request_id)
        with self.cond:
            jobs = self.pending.get(tenant, ())
            for job in jobs:
                if job[0] == request_id:
                    jobs.remove(job)
                    if not jobs:
                        del self.pending[tenant]
                    fut.error = ("the request was cancelled", "user")
                    fut.done.set()
                    return True
        return False

    def depth(self) -> int:
        with self.cond:
            return sum(len(q) for q in self.pending.values())

    def future(self, tenant: str, request_id: str) -> Future:
        fut = self.futures.get(request_id)
        if fut is None or fut.tenant != tenant:
            raise NotFound(f"request_id {request_id!r} is not one of this key's requests")
        return fut

    def _next(self) -> tuple[str, Any] | None:
        with self.cond:
            while not self.stopped and not self.pending:
                self.cond.wait()
            if self.stopped:
                return None
            tenant, jobs = next(iter(self.pending.items()))
            job = jobs.popleft()
            del self.pending[tenant]
            if jobs:  # to the back of the line: the other tenants go first
                self.pending[tenant] = jobs
            return job

    def _loop(self) -> None:
        from twinkle.utils.errors import UserError

        while (job := self._next()) is not None:
            request_id, fn = job
            if request_id is None:  # ``call``: the job reports its own outcome
                fn()
                continue
            fut = self.futures[request_id]
            start = time.perf_counter()
            try:
                fut.result = fn()
            except (UserError, ValueError) as exc:
                fut.error = (str(exc).splitlines()[0] if str(exc) else type(exc).__name__, "user")
            except Exception as exc:  # noqa: BLE001 (one tenant's failure fails its request only)
                message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
                fut.error = (message.splitlines()[0], "user" if hasattr(exc, "status") else "server")
            self.step_times.append(time.perf_counter() - start)
            fut.done.set()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
