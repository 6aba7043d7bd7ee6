"""Every switch a user may set to choose how Twinkle computes, read here and nowhere else.

Each switch is one environment variable (the table in ``kernel/README.md`` lists them with
their defaults). They are read together, once, at the first question any part of Twinkle asks;
an invalid value raises ``UserError`` naming the variable and its valid values. Within a process,
``switched({...})`` changes them for a block (what tests and benchmarks use, and what a user may
use to compare two ways in one process); ``set_switches({...})`` changes them for good.

An ``off`` switch takes its backend out of the op's chain in the registry (``twinkle kernels``
then says "switched off by ..."); the other values are read by the implementation. The master
switch ``TWINKLE_KERNELS=none`` turns every kernel off at once: ``kernelize`` patches nothing
and every call op runs only its plain torch/PEFT backend."""

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from twinkle.utils.errors import UserError

_ON = ("1", "true", "on", "yes")
_OFF = ("0", "false", "off", "no")


MASTER = "TWINKLE_KERNELS"  # "none": every op its plain torch/PEFT way (kernel/README.md)


@dataclass(frozen=True)
class Switch:
    name: str  # the environment variable
    op: str | None  # None for the master switch, which covers every op
    backend: str | None
    default: str
    values: tuple[str, ...]  # canonical values; "on"/"off" also take 1/0, true/false, yes/no
    help: str

    def parse(self, raw: str) -> str:
        value = raw.strip().lower()
        if value == "":
            return self.default
        if value in _ON and "on" in self.values:
            return "on"
        if value in _OFF and "off" in self.values:
            return "off"
        if value in self.values:
            return value
        choices = ", ".join(self.values)
        raise UserError(f"{self.name}={raw!r} is not a switch: set it to one of {choices}, or unset it")


SWITCHES: dict[str, Switch] = {
    s.name: s
    for s in (
        Switch(
            MASTER,
            None,
            None,
            "default",
            ("default", "none"),
            "none: every op its plain torch/PEFT way (kernelize patches nothing, each call op runs only "
            "its plain backend); default: the chain table",
        ),
        Switch(
            "TWINKLE_ONEDNN",
            "cpu_gemm",
            "onednn",
            "on",
            ("auto", "on", "off"),
            "frozen weights' fp32 CPU products: on: oneDNN for every shape (the same sums in every run); "
            "off: torch's own library (MKL); auto: per weight shape the faster here, as measured "
            "once and kept in <cache>/gemm/ (a fresh cache may choose otherwise)",
        ),
        Switch(
            "TWINKLE_PACKED_WEIGHTS",
            "cpu_gemm",
            "packed",
            "on",
            ("on", "off"),
            "oneDNN-packed copies of the frozen weights for the forward products (unsharded CPU training)",
        ),
        Switch(
            "TWINKLE_NATIVE_ATTENTION",
            "packed_attention",
            "native",
            "on",
            ("on", "off"),
            "packed rows' attention from the C kernel compiled on first use (CPU, fp32)",
        ),
        Switch(
            "TWINKLE_NATIVE_GEMV",
            "decode_gemv",
            "native",
            "on",
            ("on", "off"),
            "a sampler's decoding products of at most 8 rows from the C kernel compiled on first use "
            "(CPU, fp32; off: oneDNN or MKL as measured per weight shape)",
        ),
        Switch(
            "TWINKLE_NATIVE_DECODE",
            "decode_step",
            "native",
            "on",
            ("on", "off"),
            "a sampler's decoding step between its products (norms, rotation, cache, attention, gate) "
            "from the C kernel compiled on first use (CPU, fp32; off: the model's modules one by one)",
        ),
        Switch(
            "TWINKLE_NATIVE_LORA_SEGMENTS",
            "lora_segments",
            "native",
            "on",
            ("on", "off"),
            "a mixed-adapter batch's LoRA products, every adapter's run of tokens of a layer in one call "
            "of the C kernel compiled on first use (CPU, fp32; off: two torch products per run)",
        ),
        Switch(
            "TWINKLE_POOLED_ATTENTION",
            "packed_attention",
            "pooled",
            "auto",
            ("auto", "always", "off"),
            "per-sample flash attention with its backward spread over the cores: auto for rows with "
            "enough work, always for every row it can take",
        ),
        Switch(
            "TWINKLE_BATCHED_ATTENTION",
            "packed_attention",
            "batched",
            "auto",
            ("auto", "always", "off"),
            "short samples' attention as batched products: auto where the cost model says it is "
            "faster, always wherever a plan fits",
        ),
        Switch(
            "TWINKLE_FUSED_LORA",
            "lora_linear",
            "fused",
            "on",
            ("on", "off"),
            "each plain LoRA linear layer as one autograd node (off: PEFT's modules)",
        ),
        Switch(
            "TWINKLE_LORA_MLP",
            "lora_mlp",
            "fused",
            "on",
            ("on", "off"),
            "an MLP of three plain LoRA layers as one autograd node (off: layer by layer)",
        ),
        Switch(
            "TWINKLE_LORA_QKV",
            "lora_qkv",
            "fused",
            "on",
            ("on", "off"),
            "q/k/v LoRA projections and the rotary embedding as one autograd node (off: layer by layer)",
        ),
        Switch(
            "TWINKLE_BATCHED_MUON",
            "muon_step",
            "batched",
            "on",
            ("on", "off"),
            "torch.optim.Muon's Newton-Schulz iterations batched over same-shaped matrices (off: torch's own step)",
        ),
    )
}

_values: dict[str, str] = {}  # read from the environment at the first question
_listeners: list = []  # called after a change (the registry forgets its chains)


def _read(env: Mapping[str, str]) -> dict[str, str]:
    return {name: s.parse(env[name]) if name in env else s.default for name, s in SWITCHES.items()}


def value(name: str) -> str:
    """The current value of switch ``name`` (canonical: e.g. ``"auto"``, ``"on"``, ``"off"``)."""
    if not _values:
        _values.update(_read(os.environ))
    return _values[name]


def values() -> dict[str, str]:
    value(next(iter(SWITCHES)))
    return dict(_values)


def _check(changes: Mapping[str, str]) -> dict[str, str]:
    unknown = sorted(set(changes) - set(SWITCHES))
    if unknown:
        raise UserError(f"unknown kernel switch {', '.join(unknown)}; switches: {', '.join(SWITCHES)}")
    return {name: SWITCHES[name].parse(str(v)) for name, v in changes.items()}


def set_switches(changes: Mapping[str, str]) -> None:
    """Set switches for the rest of the process (values as in the environment)."""
    parsed = _check(changes)
    values()
    _values.update(parsed)
    for listener in _listeners:
        listener()


@contextmanager
def switched(changes: Mapping[str, str]) -> Iterator[None]:
    """Set switches for the duration of a block, then restore them."""
    before = values()
    set_switches(changes)
    try:
        yield
    finally:
        _values.update(before)
        for listener in _listeners:
            listener()


def reread() -> None:
    """Forget the values read so far: the next question reads the environment again."""
    _values.clear()
    for listener in _listeners:
        listener()
