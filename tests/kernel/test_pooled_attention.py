"""The pooled CPU attention: the per-sample SDPA calls' results, backward on one-thread workers."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from tolerances import attention_sums, chain_tolerances

from twinkle.kernel import switched
from twinkle.kernel.attention import pooled as cpu_attention
from twinkle.kernel.attention.packed import Segments, segment_attention


@pytest.fixture
def two_threads():
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


def _row(prefix: int, lengths: list[int]) -> tuple[Segments, list[torch.Tensor]]:
    spans, start = [], prefix
    for n in lengths:
        spans.append((start, start + n))
        start += n
    segments = Segments(tuple(spans), prefix)
    # as the model hands them over: (1, T, heads, D) transposed
    leaves = [torch.randn(1, start, h, 8).transpose(1, 2).requires_grad_() for h in (6, 2, 2)]
    return segments, leaves


def _assert_same(a, b, leaves) -> None:
    """Per-sample calls on the pool's threads sum the same terms as the per-sample calls, maybe
    in other orders: within the bound of attention's chain of fp32 sums (tolerances.py), plus the
    product of out^2's gradient; a sample that sees another's keys is off by ~1e-1 of the scale."""
    query, key = leaves[0], leaves[1]
    sums = attention_sums(query.shape[2], query.shape[3], query.shape[1] // key.shape[1]) + [2]
    torch.testing.assert_close(a, b, **chain_tolerances(sums, b))


def _run(segments, leaves, pooled):
    """``pooled``: "always" (every row it can take, whatever its work) or "off"; never the
    batched products"""
    with switched({"TWINKLE_POOLED_ATTENTION": pooled, "TWINKLE_BATCHED_ATTENTION": "off"}):
        out = segment_attention(*leaves, segments)
        grads = torch.autograd.grad(out.square().sum(), leaves)
    return [out, *grads]


@pytest.mark.parametrize("prefix", [0, 3])
def test_pooled_row_equals_the_per_sample_calls(prefix, monkeypatch, two_threads):
    torch.manual_seed(0)
    segments, leaves = _row(prefix, [5, 40, 1, 17])
    threads = []
    backward = cpu_attention._BACKWARD

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return backward(*args, **kwargs)

    plain = _run(segments, leaves, "off")
    monkeypatch.setattr(cpu_attention, "_BACKWARD", spy)
    pooled = _run(segments, leaves, "always")
    # one call per (sample, query head), all on the pool's workers
    assert len(threads) == 4 * 6 and all(name.startswith("twinkle-attention") for name in threads)
    for a, b in zip(pooled, plain, strict=True):
        _assert_same(a, b, leaves)


def test_pooled_gradients_do_not_depend_on_the_workers(monkeypatch, two_threads):
    """The same row twice, and once without the pool: bit for bit."""
    torch.manual_seed(1)
    segments, leaves = _row(3, [30, 9, 22])
    first = _run(segments, leaves, "always")
    again = _run(segments, leaves, "always")
    monkeypatch.setattr(cpu_attention, "pool", lambda threads: None)  # every call on this thread
    serial = _run(segments, leaves, "always")
    for a, b, c in zip(first, again, serial, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_pool_workers_run_one_thread_and_leave_the_process_setting(two_threads):
    workers = cpu_attention.pool(2)
    assert workers is not None
    assert torch.get_num_threads() == 2
    assert set(workers.map(lambda _: torch.get_num_threads(), range(8))) == {1}
    fresh = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    seen: list[int] = []
    fresh.start()
    fresh.join()
    assert seen == [2]  # a new thread still starts from the process's setting
    assert cpu_attention.pool(1) is None


def test_workers_that_cannot_start_leave_every_call_on_the_calling_thread(monkeypatch, two_threads):
    def fail(barrier):
        raise RuntimeError("no thread for you")

    monkeypatch.setattr(cpu_attention, "_single_threaded", fail)
    monkeypatch.setattr(cpu_attention, "START_SECONDS", 0.5)
    monkeypatch.setattr(cpu_attention, "_pool", None)
    monkeypatch.setattr(cpu_attention, "_pool_threads", 0)
    assert cpu_attention.pool(2) is None
    assert torch.get_num_threads() == 2
    assert cpu_attention.pool(2) is None  # not tried again
    torch.manual_seed(3)
    segments, leaves = _row(3, [20, 9])
    out = segment_attention(*leaves, segments)  # below MIN_WORK: the per-sample calls
    with switched({"TWINKLE_POOLED_ATTENTION": "always"}):  # the row still runs
        pooled = segment_attention(*leaves, segments)
        pooled.sum().backward()
    _assert_same(pooled, out, leaves)


def test_a_worker_failing_before_the_last_submit_still_gives_no_pool(monkeypatch, two_threads):
    """The pool breaks as soon as one worker's start fails: a later submit raises, which must
    read as "no pool", not escape to the caller."""

    def fail(barrier):
        raise RuntimeError("no thread for you")

    class SlowSubmit(ThreadPoolExecutor):
        def submit(self, *args, **kwargs):
            time.sleep(0.2)  # the first worker has failed by the second submit
            return super().submit(*args, **kwargs)

    monkeypatch.setattr(cpu_attention, "_single_threaded", fail)
    monkeypatch.setattr(cpu_attention, "ThreadPoolExecutor", SlowSubmit)
    monkeypatch.setattr(cpu_attention, "_pool", None)
    monkeypatch.setattr(cpu_attention, "_pool_threads", 0)
    assert cpu_attention.pool(2) is None
    assert torch.get_num_threads() == 2


def test_an_unused_output_gets_a_zero_gradient(two_threads):
    torch.manual_seed(2)
    q0, k0, v0, q1, k1, v1 = (torch.randn(1, h, n, 8, requires_grad=True) for n in (7, 11) for h in (4, 2, 2))
    out0, _ = cpu_attention.pooled_causal_attention([(q0, k0, v0), (q1, k1, v1)], None)
    out0.sum().backward()
    assert q1.grad is not None and not q1.grad.any() and not k1.grad.any()
    assert q0.grad.abs().sum() > 0


def test_only_large_fp32_cpu_rows_with_threads_are_pooled(two_threads):
    query = torch.zeros(1, 2, 4, 8)
    work = cpu_attention.MIN_WORK
    assert cpu_attention.usable(query, work)
    assert not cpu_attention.usable(query, work - 1)
    assert not cpu_attention.usable(query.bfloat16(), work)
    with switched({"TWINKLE_POOLED_ATTENTION": "always"}):
        assert cpu_attention.usable(query, 1)
    with switched({"TWINKLE_POOLED_ATTENTION": "off"}):
        assert not cpu_attention.usable(query, work)
    torch.set_num_threads(1)
    assert not cpu_attention.usable(query, work)


def _in_forked_child(queue) -> None:
    # only the state: a forked child's first OpenMP region after the parent's can hang in
    # libgomp whatever Twinkle does (hence torch's one-thread DataLoader workers)
    queue.put((cpu_attention._pool, cpu_attention._pool_threads))


def test_a_forked_child_forgets_the_parents_pool(two_threads):
    """fork copies no thread: a child that used the parent's pool would wait forever."""
    import multiprocessing

    assert cpu_attention.pool(2) is not None
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_in_forked_child, args=(queue,))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0
    assert queue.get(timeout=5) == (None, 0)
    assert cpu_attention._pool is not None  # the parent keeps its own
