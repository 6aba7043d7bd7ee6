"""Causal attention of a packed row's samples on the CPU, backward spread over the cores.

torch's CPU flash kernel splits its backward over the threads by key/value head, and a few
key/value heads do not share out evenly over the threads (three heads over two threads, say: its
backward then gains much less from the second thread than the forward does). Here the forward is the
kernel's own, once per sample on all threads. The backward runs one single-threaded kernel call per
(sample, query head) on a pool of one-thread workers, one per thread torch may use, longest first.
Each call's gradients are whole; a key/value head's gradient is the sum of its query heads' parts,
added in head order on the calling thread, so the result does not depend on which worker ran what.

Used only where it pays: fp32 on the CPU, torch built with OpenMP, more than one thread, and a
row with enough attention work (``MIN_WORK``; ``TWINKLE_POOLED_ATTENTION=always`` drops that
bound)."""

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures.thread import BrokenThreadPool
from typing import Any

import torch

from twinkle.kernel import registry, switches
from twinkle.kernel.attention.sdpa import zero_queries_first

_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default

# Query-key pairs of a row (summed over its samples) below which the row keeps the per-sample
# SDPA calls: below it the pool costs more than it gains (bench/micro/attention_bench.py, forward
# + backward; about even at four samples of ~400 tokens).
MIN_WORK = 1024 * 1024

START_SECONDS = 60.0  # for the workers to start; past it the pool is given up

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_threads = 0


OPENMP = "OpenMP" in torch.__config__.parallel_info()
registry.register_call("packed_attention", "pooled", lambda: OPENMP, "torch built with OpenMP")


def _single_threaded(barrier: threading.Barrier) -> None:
    torch.get_num_threads()  # this thread's own lazy set-up first, or it would undo the next line
    torch.set_num_threads(1)  # under OpenMP: this thread's parallel regions (and MKL's setting)
    barrier.wait()


def _forget_pool() -> None:
    """In a forked child: the workers were not copied, so the pool must not be used."""
    global _pool, _pool_threads
    _pool, _pool_threads = None, 0


os.register_at_fork(after_in_child=_forget_pool)


def pool(threads: int) -> ThreadPoolExecutor | None:
    """``threads`` workers that each run torch ops on one thread; None when that cannot be had."""
    global _pool, _pool_threads
    if threads < 2 or not OPENMP:
        return None
    with _lock:
        if _pool_threads != threads:
            if _pool is not None:
                _pool.shutdown(wait=True)
            barrier = threading.Barrier(threads + 1)
            new = ThreadPoolExecutor(threads, "twinkle-attention", _single_threaded, (barrier,))
            try:
                for _ in range(threads):  # every worker starts now (each waits in the barrier)
                    new.submit(lambda: None)
                barrier.wait(timeout=START_SECONDS)
            except (threading.BrokenBarrierError, BrokenThreadPool):
                # BrokenThreadPool: a worker's start already failed before the last submit
                # a worker could not start: every call runs on the calling thread from now on
                barrier.abort()
                new.shutdown(wait=False)
                torch.set_num_threads(threads)
                _pool, _pool_threads = None, threads
                return None
            # set_num_threads also wrote the process-wide setting; put it back for everyone else
            torch.set_num_threads(threads)
            _pool, _pool_threads = new, threads
        return _pool


class PooledCausalAttention(torch.autograd.Function):
    """Square causal attention of independent samples: ``apply(scale, q0, k0, v0, q1, ...)``
    with ``q (1, H, L, D)`` and ``k, v (1, KV, L, D)`` -> one ``(1, H, L, D)`` output each."""

    @staticmethod
    def forward(ctx: Any, scale: float | None, *qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs, saved = [], []
        for i in range(0, len(qkv), 3):
            q, k, v = qkv[i : i + 3]
            out, lse = _FORWARD(q, k, v, 0.0, True, scale=scale)
            outputs.append(out)
            saved += [q, k, v, out, lse]
        ctx.save_for_backward(*saved)
        ctx.scale = scale
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = ctx.saved_tensors
        samples = [saved[i : i + 5] for i in range(0, len(saved), 5)]
        heads, kv_heads = samples[0][0].shape[1], samples[0][1].shape[1]
        group = heads // kv_heads
        # one unit per (sample, query head): 9 a sample for SmolLM2, so even one sample splits
        # evenly enough; a key/value head's gradient is then the sum of its group's parts
        units = [(i, h) for i in range(len(samples)) for h in range(heads)]
        units.sort(key=lambda u: -(samples[u[0]][0].shape[2] ** 2))  # longest first: the queue balances
        # an output nobody used has no gradient: zeros, made once per sample, not once per head
        grads = tuple(
            g if g is not None else torch.zeros_like(s[3]) for g, s in zip(grads, samples, strict=True)
        )

        def run(unit: tuple[int, int]) -> tuple[torch.Tensor, ...]:
            i, h = unit
            q, k, v, out, lse = samples[i]
            hs, kvs = slice(h, h + 1), slice(h // group, h // group + 1)
            return _BACKWARD(
                grads[i][:, hs],
                q[:, hs],
                k[:, kvs],
                v[:, kvs],
                out[:, hs],
                lse[:, hs],
                0.0,
                True,
                scale=ctx.scale,
            )

        workers = pool(torch.get_num_threads())
        results = dict(zip(units, workers.map(run, units) if workers else map(run, units), strict=True))
        grad_inputs: list[torch.Tensor | None] = [None]
        for i in range(len(samples)):
            parts = [results[(i, h)] for h in range(heads)]
            grad_q = torch.cat([part[0] for part in parts], dim=1)
            # each key/value head: its group's parts added in head order, whichever worker ran them
            grad_k, grad_v = (
                torch.cat(
                    [sum(part[j] for part in parts[g * group : (g + 1) * group]) for g in range(kv_heads)],
                    dim=1,
                )
                for j in (1, 2)
            )
            grad_inputs += [grad_q, grad_k, grad_v]
        return tuple(grad_inputs)


def pooled_causal_attention(
    triples: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], scale: float | None
) -> list[torch.Tensor]:
    flat = [t for triple in triples for t in triple]
    return list(PooledCausalAttention.apply(scale, *flat))


def usable(query: torch.Tensor, work: int) -> bool:
    """Whether a row of fp32 CPU attention with ``work`` query-key pairs takes this path."""
    return (
        query.device.type == "cpu"
        and query.dtype == torch.float32
        and torch.get_num_threads() > 1
        and registry.enabled("packed_attention", "pooled")
        and (work >= MIN_WORK or switches.value("TWINKLE_POOLED_ATTENTION") == "always")
    )


def pooled_rows(calls: list, scaling: float | None) -> list[torch.Tensor]:
    """Every sample as a square causal call (zero queries stand in for a shared prefix's, as in
    ``sdpa.attend``; here also below one key block, where the masked call would be a little
    faster, since only rows with long samples come here), backward spread over the cores."""
    triples = [(zero_queries_first(q, shared), k, v) for q, k, v, shared in calls]
    outputs = pooled_causal_attention(triples, scaling)
    return [out[:, :, shared:] for out, (_, _, _, shared) in zip(outputs, calls, strict=True)]
