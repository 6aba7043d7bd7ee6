"""Whole training steps with one of Twinkle's choices on and off, paired in one process.

    python bench/step_ab.py --switch batched-attention --workload W1 --batches 16 --rounds 3
    python bench/step_ab.py --switch packed-weights --workload W2 --batches 4 --rounds 2

The same batches run with the switch on and off, alternating which goes first; prints the median
step of each. The model trains on every run, so both see the same sequence of weights but not
the same ones at the same batch: that shifts both alike.

Switches:
- ``packed-weights``: the frozen weights' oneDNN-packed copies (``twinkle.utils.gemm``) or the
  dense weights;
- ``onednn``: the frozen weights' products routed as ``TWINKLE_ONEDNN`` says (``auto``: each
  shape to the library measured faster, ``1``: all to oneDNN; ``twinkle.utils.gemm``) or all
  through torch's own (MKL);
- ``batched-attention``: short rows' attention as batched products where the cost model picks
  them (``twinkle.model.batched_attention``), or always the per-sample flash calls;
- ``lora-qkv``: the attention layers' q/k/v projections and rotary embedding as one node
  (``twinkle.model.lora_qkv``), or layer by layer."""

import argparse
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
from twinkle.model import batched_attention, lora_qkv
from twinkle.utils import gemm


def _packed_weights() -> Callable[[bool], None]:
    assert gemm.packed_bytes(), "nothing was packed: is TWINKLE_ONEDNN off?"
    table = gemm._packed

    def switch(on: bool) -> None:
        gemm._packed = table if on else {}

    return switch


def _onednn() -> Callable[[bool], None]:
    mode = gemm._mode()
    assert mode != "off", "oneDNN is off in this process (TWINKLE_ONEDNN=0, or not built)"

    def switch(on: bool) -> None:
        gemm._state["mode"] = mode if on else "off"

    return switch


def _batched_attention() -> Callable[[bool], None]:
    def switch(on: bool) -> None:
        batched_attention.CHOICE = "auto" if on else "never"

    return switch


def _lora_qkv() -> Callable[[bool], None]:
    def switch(on: bool) -> None:
        lora_qkv.USE = on

    return switch


SWITCHES = {
    "packed-weights": _packed_weights,
    "onednn": _onednn,
    "batched-attention": _batched_attention,
    "lora-qkv": _lora_qkv,
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
    switch = SWITCHES[switch_name]()
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
    for r in range(rounds):
        for i, batch in enumerate(data):
            for on in (True, False) if (i + r) % 2 == 0 else (False, True):
                times[on].append(step(batch, on))
    switch(True)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(
        f"{workload} {switch_name}: median step off {off:.3f} s, on {on:.3f} s, on / off {on / off:.3f} "
        f"({len(times[True])} steps each)"
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
