"""The server's queue on its own: two lanes taken in turn, sliced jobs that yield the worker,
a ceiling on one request's running time, a bound on each tenant's line, futures that expire."""

import threading
import time

import pytest

from twinkle.server.errors import NotFound, TooMany
from twinkle.server.queue import Queue


def _hold(queue: Queue, tenant: str = "hold"):
    """Occupy the worker until the returned event is set (so the rest can queue up)."""
    gate, running = threading.Event(), threading.Event()
    queue.submit(tenant, lambda: (running.set(), gate.wait()))
    assert running.wait(10)
    return gate


def _wait(queue: Queue, ids: list[str]) -> None:
    for rid in ids:
        assert queue.futures[rid].done.wait(10)


def test_a_sliced_job_gives_the_worker_to_the_other_lane_and_tenants_between_slices():
    queue, ran = Queue(max_started=2), []

    def sliced(name: str, slices: int):
        for i in range(slices):
            ran.append(f"{name}{i}")
            yield
        return name

    gate = _hold(queue)
    long = queue.submit("a", lambda: sliced("s", 4), lane="sample")
    short = queue.submit("b", lambda: sliced("t", 1), lane="sample")
    steps = [queue.submit("c", lambda i=i: ran.append(f"c{i}"), lane="train") for i in range(3)]
    gate.set()
    _wait(queue, [long, short, *steps])
    queue.stop()
    # the lanes alternate; in the sample lane a and b take turns, a's paused job first in its line
    assert ran == ["s0", "c0", "t0", "c1", "s1", "c2", "s2", "s3"]
    assert queue.futures[long].result == "s" and queue.futures[short].result == "t"


def test_a_tenants_requests_keep_their_order_while_one_is_paused():
    queue, ran = Queue(), []

    def sliced():
        for i in range(3):
            ran.append(f"s{i}")
            yield

    gate = _hold(queue)
    first = queue.submit("a", sliced, lane="sample")
    second = queue.submit("a", lambda: ran.append("after"), lane="sample")
    gate.set()
    _wait(queue, [first, second])
    queue.stop()
    assert ran == ["s0", "s1", "s2", "after"]


def test_at_most_max_started_sliced_jobs_are_under_way():
    queue, ran = Queue(max_started=1), []

    def sliced(name: str):
        for i in range(2):
            ran.append(f"{name}{i}")
            yield

    gate = _hold(queue)
    ids = [queue.submit(t, lambda t=t: sliced(t), lane="sample") for t in ("a", "b")]
    ids.append(queue.submit("c", lambda: ran.append("c"), lane="train"))
    gate.set()
    _wait(queue, ids)
    queue.stop()
    assert ran == ["a0", "c", "a1", "b0", "b1"]  # b starts only when a is done; c runs between


def test_a_sliced_job_past_the_ceiling_is_stopped_and_cleans_up():
    queue, cleaned = Queue(max_seconds=0.2), threading.Event()

    def forever():
        try:
            while True:
                time.sleep(0.02)
                yield
        finally:
            cleaned.set()

    rid = queue.submit("a", forever, lane="sample")
    other = queue.submit("b", lambda: "fine")
    _wait(queue, [rid, other])
    message, kind = queue.futures[rid].error
    assert kind == "user" and "--max-request-seconds" in message and "0.2 s" in message
    assert cleaned.is_set() and queue.futures[other].result == "fine"
    assert not queue.started  # its place is free for the next sliced job
    queue.stop()


def test_a_tenants_line_is_bounded_and_the_refusal_says_when_to_retry():
    queue = Queue(max_queued=3)
    gate = _hold(queue, "a")
    ids = [queue.submit("a", lambda: None) for _ in range(2)]
    with pytest.raises(TooMany) as refused:
        queue.submit("a", lambda: None)
    assert refused.value.headers["x-should-retry"] == "true" and "retry-after" in refused.value.headers
    other = queue.submit("b", lambda: None)  # another key's line is its own
    gate.set()
    _wait(queue, [*ids, other])
    queue.submit("a", lambda: None)  # room again once they finished
    queue.stop()


def test_finished_futures_expire_after_retrieval_and_after_their_ttl():
    queue = Queue(future_ttl=0.3, keep_after_retrieval=0.1)
    queue.sweep_every = 0.0
    ids = [queue.submit("a", lambda i=i: {"i": i}) for i in range(200)]
    _wait(queue, ids)
    fetched = ids[:100]
    for rid in fetched:
        queue.retrieved(queue.future("a", rid))
    time.sleep(0.15)
    queue.future("a", ids[-1])  # a lookup sweeps
    assert set(queue.futures) == set(ids[100:])  # retrieved ones gone, the others still kept
    time.sleep(0.2)
    with pytest.raises(NotFound, match="expired"):
        queue.future("a", ids[-1])
    assert not queue.futures and not queue.submitted
    queue.stop()


def test_an_unfinished_future_never_expires():
    queue = Queue(future_ttl=0.05, keep_after_retrieval=0.05)
    queue.sweep_every = 0.0
    gate = _hold(queue)
    rid = queue.submit("a", lambda: "late")
    time.sleep(0.2)
    assert queue.future("a", rid).done.is_set() is False
    gate.set()
    _wait(queue, [rid])
    assert queue.future("a", rid).result == "late"
    queue.stop()
