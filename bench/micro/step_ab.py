"""Whole training steps with one of Twinkle's choices on and off, paired in one process.

    python bench/micro/step_ab.py --switch batched-attention --workload W1 --batches 16 --rounds 3
    python bench/micro/step_ab.py --switch packed-weights --workload W2 --batches 4 --rounds 2

The same batches run with the switch on and off, alternating which goes first; prints the median
step of each, the median of each batch's paired ratio (on a shared virtual machine the speed
drifts by tens of percent over minutes, which the pairing cancels), and each way's page faults and kernel (system) time per step. The model trains on
every run, so both see the same sequence of weights but not the same ones at the same batch:
that shifts both alike.

Switches (each a kernel switch, ``twinkle/kernel/README.md``; on: its default, off: turned off):
- ``packed-weights``: the frozen weights' oneDNN-packed copies, or the dense weights;
- ``onednn``: the frozen weights' products routed as ``TWINKLE_ONEDNN`` says, or all through
  torch's own library (MKL);
- ``batched-attention``: short rows' attention as batched products where the cost model picks
  them, or the per-sample flash calls (both ways without the C kernel);
- ``native-attention``: packed rows' attention from the C kernel, or the rest of the chain;
- ``lora-qkv``: the attention layers' q/k/v projections and rotary embedding as one node, or
  layer by layer;
- ``lora-dropout``: the LoRA adapters' dropout at the contract's 0.05, or 0 (not a kernel
  switch: the cost of the masks on the fused path).

The model trains with the contract's optimizer (Muon) and, unless a switch changes it, its LoRA
dropout 0.05."""

import argparse
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import _paths  # noqa: F401  (puts bench/ and bench/harness on sys.path)
import torch
from common import build_dataset, profiled_model, sync
from run import WORKLOADS, prepare

import twinkle
from twinkle.dataloader import DataLoader
from twinkle.kernel import cpu_gemm as gemm
from twinkle.kernel import set_switches, switches


def _switch(name: str, on: str = "on", off: str = "off") -> Callable[[bool], None]:
    """Kernel switch ``name`` set to ``on``'s or ``off``'s value for each step."""

    def switch(enabled: bool) -> None:
        set_switches({name: on if enabled else off})

    return switch


def _onednn() -> Callable[[bool], None]:
    """The products routed as ``TWINKLE_ONEDNN`` says (auto: each shape to the faster library), or
    all through torch's own."""
    mode = switches.value("TWINKLE_ONEDNN")
    assert gemm.onednn_enabled(), "oneDNN is off in this process (TWINKLE_ONEDNN=0, or not built)"
    return _switch("TWINKLE_ONEDNN", on=mode)


def _packed_weights() -> Callable[[bool], None]:
    assert gemm.packed_bytes(), "nothing was packed: is TWINKLE_ONEDNN off?"
    return _switch("TWINKLE_PACKED_WEIGHTS")


def _batched_attention() -> Callable[[bool], None]:
    set_switches({"TWINKLE_NATIVE_ATTENTION": "off"})  # both ways without the C kernel, which runs first
    return _switch("TWINKLE_BATCHED_ATTENTION", on="auto")


def _lora_dropout(model) -> Callable[[bool], None]:
    modules = [m for m in model.model.modules() if isinstance(m, torch.nn.Dropout)]
    assert modules and all(m.p == 0.05 for m in modules), "expected the contract's LoRA dropout 0.05"

    def switch(enabled: bool) -> None:
        for module in modules:
            module.p = 0.05 if enabled else 0.0

    return switch


SWITCHES = {
    "packed-weights": _packed_weights,
    "onednn": _onednn,
    "batched-attention": _batched_attention,
    "native-attention": lambda: _switch("TWINKLE_NATIVE_ATTENTION"),
    "lora-qkv": lambda: _switch("TWINKLE_LORA_QKV"),
    "lora-dropout": None,  # needs the model: _lora_dropout
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
    switch = _lora_dropout(model) if switch_name == "lora-dropout" else SWITCHES[switch_name]()
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
    ratios = []  # each batch's step on over its step off, the two run back to back
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
            ratios.append(times[True][-1] / times[False][-1])
    switch(True)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(
        f"{workload} {switch_name}: median step off {off:.3f} s, on {on:.3f} s, on / off {on / off:.3f} "
        f"({len(times[True])} steps each)"
    )
    quartiles = statistics.quantiles(ratios, n=4)
    print(
        f"paired: median of each batch's on / off {statistics.median(ratios):.3f} "
        f"(quartiles {quartiles[0]:.3f} to {quartiles[2]:.3f}; robust to the machine's speed drifting)"
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
