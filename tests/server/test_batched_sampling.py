"""Sampling continuously batched across tenants: requests of different adapters, prompt lengths,
``max_tokens`` and sampling parameters join one decoding batch at different steps and leave it as
they finish, and each draws the tokens it draws alone with the same seed; one that leaves early
(cancelled, or stopped at the ceiling) takes its rows out without changing the others'; the queue
charges a batched request for the decoding it took part in and stops a cancelled one."""

import threading
import time

import numpy as np
import pytest
import torch
from serving import KEY_A, KEY_B

# (adapter, prompt, sampling params, num_samples, seed, the step it joins at)
REQUESTS = [
    ("a", [5, 6, 7, 8, 9], {"max_tokens": 20, "temperature": 0.0}, 1, 0, 0),
    ("b", list(range(20, 31)), {"max_tokens": 30, "temperature": 1.0, "top_p": 0.9}, 3, 7, 2),
    ("c", [40, 41, 42], {"max_tokens": 12, "temperature": 0.8, "top_k": 20}, 2, 3, 5),
    ("a", [9, 8, 7, 6, 5, 4, 3, 2], {"max_tokens": 25, "temperature": 1.0, "stop": [17]}, 2, 11, 5),
    ("b", [60, 61], {"max_tokens": 8, "temperature": 0.0}, 1, 0, 9),
]


def _core(tiny_model_dir):
    """A model with three adapters of different ranks whose LoRA B is not zero (each changes the
    model's outputs, so a row run through another's adapter would draw other tokens)."""
    from twinkle.server.core import ModelCore

    torch.manual_seed(0)
    core = ModelCore(str(tiny_model_dir), max_loras=4, max_r=8)
    for i, (name, rank) in enumerate((("a", 4), ("b", 8), ("c", 2))):
        core.add(name, rank)
        gen = torch.Generator().manual_seed(100 + i)
        shapes = core.model.slots.export_names(name)
        assert not core.model.slots.load(name, {k: torch.randn(s, generator=gen) * 0.5 for k, s in shapes})
    return core


def _alone(core) -> list[list[tuple]]:
    return [core.sample(name, prompt, params, n, seed) for name, prompt, params, n, seed, _ in REQUESTS]


def _batched(core, close_at: dict[int, int] | None = None) -> tuple[list, int]:
    """Run ``REQUESTS`` through ``sample_steps`` (one decoding step a slice), each starting at its
    step; the ones in ``close_at`` (index -> step) are closed there. Their values (None when
    closed) and the most requests the batch held at once."""
    close_at = close_at or {}
    results, live, widest, step = [None] * len(REQUESTS), {}, 0, 0
    while step == 0 or live:
        for i, (name, prompt, params, n, seed, join) in enumerate(REQUESTS):
            if join == step:
                live[i] = core.sample_steps(name, prompt, params, n, seed, slice_seconds=0.0)
        for i in list(live):
            if close_at.get(i) == step:
                live.pop(i).close()
                continue
            try:
                next(live[i])
            except StopIteration as end:
                results[i] = end.value
                del live[i]
            widest = max(widest, len(core.batch.streams))
        step += 1
    return results, widest


@pytest.mark.parametrize("lean", [True, False], ids=["lean-step", "model-forward"])
def test_requests_joining_one_batch_at_different_steps_draw_the_tokens_they_draw_alone(tiny_model_dir, lean):
    core = _core(tiny_model_dir)
    alone = _alone(core)
    batch = core.decode_batch()
    assert batch.lean is not None  # the tiny Llama decodes through the written-out step
    if not lean:
        batch.lean = None  # the model's own forward, as on an accelerator
    batched, widest = _batched(core)
    assert widest >= 3  # they shared the batch, not took turns
    assert batch.cache is None and not batch.streams and not batch.pending  # all left
    for got, want in zip(batched, alone, strict=True):
        assert [t for t, _, _ in got] == [t for t, _, _ in want]
        assert [r for _, _, r in got] == [r for _, _, r in want]
        for (_, g, _), (_, w, _) in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-4)  # another summation order at most
    assert {r for seqs in alone for _, _, r in seqs} == {"stop", "length"}  # both endings were met


def test_a_request_that_leaves_early_takes_its_rows_and_the_others_draw_the_same(tiny_model_dir):
    core = _core(tiny_model_dir)
    alone = _alone(core)
    batched, _ = _batched(core, close_at={1: 6, 2: 5})  # b mid-decode; c before its first slice
    assert batched[1] is None and batched[2] is None
    for i in (0, 3, 4):
        assert [t for t, _, _ in batched[i]] == [t for t, _, _ in alone[i]]
    assert core.batch.cache is None and not core.batch.streams and not core.batch.pending


def test_a_failed_step_fails_every_request_in_the_batch_and_the_batch_starts_again(tiny_model_dir):
    core = _core(tiny_model_dir)
    first = core.sample_steps("a", [5, 6, 7], {"max_tokens": 20, "temperature": 0.0}, 1, 0, slice_seconds=0.0)
    second = core.sample_steps("b", [8, 9], {"max_tokens": 20, "temperature": 0.0}, 2, 0, slice_seconds=0.0)
    next(first)
    next(second)
    broken = core.decode_batch()
    broken.lean = lambda *a: (_ for _ in ()).throw(RuntimeError("the step broke"))
    with pytest.raises(RuntimeError, match="the step broke"):
        next(first)
    with pytest.raises(RuntimeError, match="the step broke"):
        next(second)
    broken.lean = None
    again = core.sample_steps("a", [5, 6, 7], {"max_tokens": 4, "temperature": 0.0}, 1, 0, slice_seconds=None)
    with pytest.raises(StopIteration) as end:
        next(again)
    assert [t for t, _, _ in end.value.value] == [
        t for t, _, _ in core.sample("a", [5, 6, 7], {"max_tokens": 4, "temperature": 0.0}, 1, 0)
    ]


def test_the_queue_charges_what_a_slice_yields_and_stops_a_cancelled_sliced_job():
    from twinkle.server.queue import Queue

    queue, closed = Queue(max_seconds=1.0, max_started=2), threading.Event()

    def charged():
        while True:
            yield 0.4  # decoding done for it in other jobs' slices too

    def forever():
        try:
            while True:
                time.sleep(0.01)
                yield
        finally:
            closed.set()

    slow = queue.submit("a", charged, lane="sample")
    assert queue.futures[slow].done.wait(10)
    assert "--max-request-seconds" in queue.futures[slow].error[0]  # 3 slices of 0.4 s, not their own time
    rid = queue.submit("b", forever, lane="sample")
    deadline = time.monotonic() + 10
    while rid not in queue.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert queue.cancel("b", rid)
    assert queue.futures[rid].done.wait(10)
    assert queue.futures[rid].error == ("the request was cancelled", "user") and closed.is_set()
    assert not queue.started
    queue.stop()


def test_two_tenants_sampling_at_once_through_the_server_get_what_each_gets_alone(server, tiny_model_dir):
    import tinker
    from tinker import types

    asks = [
        (KEY_A, [5, 6, 7, 8], types.SamplingParams(max_tokens=300, temperature=1.0, seed=3), 2),
        (KEY_B, [9, 10], types.SamplingParams(max_tokens=200, temperature=0.0), 1),
    ]
    clients = {
        key: tinker.ServiceClient(base_url=server.url, api_key=key).create_sampling_client(
            base_model=str(tiny_model_dir)
        )
        for key in (KEY_A, KEY_B)
    }

    def ask(key, tokens, params, n):
        return clients[key].sample(types.ModelInput.from_ints(tokens), n, params)

    def tokens(future) -> list[list[int]]:
        return [list(s.tokens) for s in future.result().sequences]

    one_by_one = [tokens(ask(*a)) for a in asks]
    batch, widest = server.app.state.server.engine.core.batch, []
    step = batch._step
    batch._step = lambda: (widest.append(len(batch.streams)), step())[1]
    together = [ask(*a) for a in asks]
    assert [tokens(f) for f in together] == one_by_one
    assert max(widest) == 2  # the two requests decoded in one batch


def test_a_failed_prefill_fails_its_request_alone(tiny_model_dir):
    core = _core(tiny_model_dir)
    params = {"max_tokens": 10, "temperature": 0.0}
    good = core.sample_steps("a", [5, 6, 7], params, 1, 0, slice_seconds=0.0)
    next(good)
    bad = core.sample_steps("no-such-adapter", [8, 9], params, 1, 0, slice_seconds=0.0)
    with pytest.raises(KeyError):
        next(bad)
    while True:
        try:
            next(good)
        except StopIteration as end:
            assert end.value == core.sample("a", [5, 6, 7], params, 1, 0)
            break
