"""Whole training steps with one of Twinkle's choices on and off, paired in one process.

    python bench/step_ab.py --switch batched-attention --workload W1 --batches 16 --rounds 3
    python bench/step_ab.py --switch packed-weights --workload W2 --batches 4 --rounds 2

The same batches run with the switch on and off, alternating which goes first; prints the median
step of each, and each way's page faults and kernel (system) time per step. The model trains on
every run, so both see the same sequence of weights but not the same ones at the same batch:
that shifts both alike.

Switches:
- ``packed-weights``: the frozen weights' oneDNN-packed copies (``twinkle.utils.gemm``) or the
  dense weights;
- ``onednn``: the frozen weights' products routed as ``TWINKLE_ONEDNN`` says (``auto``: each
  shape to the library measured faster, ``1``: all to oneDNN; ``twinkle.utils.gemm``) or all
  through torch's own (MKL);
- ``batched-attention``: short rows' attention as batched products where the cost model picks
  them (``twinkle.model.batched_attention``), or always the per-sample flash calls;
- ``native-attention``: packed rows' attention from the C kernel
  (``twinkle.model.native_attention``), or as before it (the batched products, the pooled or
  per-sample flash calls);
- ``lora-qkv``: the attention layers' q/k/v projections and rotary embedding as one node
  (``twinkle.model.lora_qkv``), or layer by layer.

Two alternatives we measured and did not adopt (on: the alternative; off: Twinkle's routing):
- ``openblas``: every frozen weight's fp32 product through numpy's OpenBLAS (set
  ``OPENBLAS_NUM_THREADS`` to torch's thread count);
- ``packed-transposed``: the input gradients ``g @ W`` from a oneDNN-packed copy of ``W.T``, the
  forwards from the dense ``W`` (the same memory as packing ``W`` for the forwards)."""

import argparse
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import build_dataset, profiled_model, sync
from run import WORKLOADS, prepare

import twinkle
from twinkle.dataloader import DataLoader
from twinkle.loss import fused_linear_ce
from twinkle.model import batched_attention, lora_linear, lora_qkv, native_attention
from twinkle.utils import gemm

# the modules that imported gemm's two products by name
PRODUCT_USERS = (lora_linear, lora_qkv, fused_linear_ce)


def _route(linear: Callable, times_weight: Callable) -> Callable[[bool], None]:
    """A switch between Twinkle's own products (off) and these two (on), where they apply."""

    def switch(on: bool) -> None:
        for module in PRODUCT_USERS:
            module.linear = linear if on else gemm.linear
            module.times_weight = times_weight if on else gemm.times_weight

    return switch


def _openblas(_model) -> Callable[[bool], None]:
    import numpy as np

    def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.matmul(a.detach().numpy(), b.detach().numpy()))

    def linear(x, w, bias=None):
        if not gemm._eligible(x, w, bias):
            return gemm.linear(x, w, bias)
        out = product(x, w.t())
        return out if bias is None else out.add_(bias)

    def times_weight(g, w):
        return product(g, w) if gemm._eligible(g, w) else gemm.times_weight(g, w)

    return _route(linear, times_weight)


def _packed_transposed(model) -> Callable[[bool], None]:
    transposed = {
        id(m.weight): gemm._pack(m.weight.t().contiguous())
        for m in model.model.modules()
        if isinstance(m, torch.nn.Linear) and gemm._packable(m.weight)
    }
    print(f"packed copies of W.T: {sum(t.nbytes for t in transposed.values()) / 2**20:.0f} MiB")

    def linear(x, w, bias=None):
        if id(w) in transposed and gemm._eligible(x, w, bias):
            return gemm._linear_pointwise(x, w, bias)  # the dense weight
        return gemm.linear(x, w, bias)

    def times_weight(g, w):
        if id(w) in transposed and gemm._eligible(g, w):
            return gemm._linear_pointwise(g, transposed[id(w)], None)
        return gemm.times_weight(g, w)

    return _route(linear, times_weight)


def _packed_weights(_model) -> Callable[[bool], None]:
    assert gemm.packed_bytes(), "nothing was packed: is TWINKLE_ONEDNN off?"
    table = gemm._packed

    def switch(on: bool) -> None:
        gemm._packed = table if on else {}

    return switch


def _onednn(_model) -> Callable[[bool], None]:
    mode = gemm._mode()
    assert mode != "off", "oneDNN is off in this process (TWINKLE_ONEDNN=0, or not built)"

    def switch(on: bool) -> None:
        gemm._state["mode"] = mode if on else "off"

    return switch


def _batched_attention(_model) -> Callable[[bool], None]:
    os.environ[native_attention.ENV] = "0"  # both ways without the C kernel, which runs first

    def switch(on: bool) -> None:
        batched_attention.CHOICE = "auto" if on else "never"

    return switch


def _native_attention(_model) -> Callable[[bool], None]:
    def switch(on: bool) -> None:
        os.environ[native_attention.ENV] = "1" if on else "0"

    return switch


def _lora_qkv(_model) -> Callable[[bool], None]:
    def switch(on: bool) -> None:
        lora_qkv.USE = on

    return switch


SWITCHES = {
    "packed-weights": _packed_weights,
    "onednn": _onednn,
    "batched-attention": _batched_attention,
    "native-attention": _native_attention,
    "lora-qkv": _lora_qkv,
    "openblas": _openblas,
    "packed-transposed": _packed_transposed,
}


def paired_steps(switch_name: str, workload: str, batches: int, rounds: int, threads: int) -> None:
    spec = prepare(
        workload,
        argparse.Namespace(
            steps=batches, warmup=2, seed=42, threads=threads, model="smollm2", tokenizer=None, dtype="auto"
        ),
        Path(tempfile.mkdtemp(prefix="twinkle-ab-")),
    )
    twinkle.initialize(seed=42)
    dataset = build_dataset(spec)
    model = profiled_model(spec)
    switch = SWITCHES[switch_name](model)
    data = [b for _, b in zip(range(batches), DataLoader(dataset=dataset, batch_size=4), strict=False)]

    def step(batch, on: bool) -> float:
        switch(on)
        start = time.perf_counter()
        model.forward_backward(inputs=batch, task="fused_lm_ce")
        model.clip_grad_and_step(max_grad_norm=1.0)
        sync()
        return time.perf_counter() - start

    for batch in data[:2]:  # warm-up, both ways
        step(batch, True)
        step(batch, False)
    times = {True: [], False: []}
    faults = {True: 0, False: 0}  # minor page faults, each way
    system = {True: 0.0, False: 0.0}  # seconds in the kernel, each way
    for r in range(rounds):
        for i, batch in enumerate(data):
            for on in (True, False) if (i + r) % 2 == 0 else (False, True):
                before = resource.getrusage(resource.RUSAGE_SELF)
                times[on].append(step(batch, on))
                after = resource.getrusage(resource.RUSAGE_SELF)
                faults[on] += after.ru_minflt - before.ru_minflt
                system[on] += after.ru_stime - before.ru_stime
    switch(True)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(
        f"{workload} {switch_name}: median step off {off:.3f} s, on {on:.3f} s, on / off {on / off:.3f} "
        f"({len(times[True])} steps each)"
    )
    steps = len(times[True])
    print(
        f"per step: page faults off {faults[False] / steps:.0f}, on {faults[True] / steps:.0f}; "
        f"kernel time off {system[False] / steps:.3f} s, on {system[True] / steps:.3f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--switch", choices=list(SWITCHES), required=True)
    parser.add_argument("--workload", choices=list(WORKLOADS), default="W1")
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    paired_steps(args.switch, args.workload, args.batches, args.rounds, args.threads)


if __name__ == "__main__":
    main()
