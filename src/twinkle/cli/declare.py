"""How an argument field is declared: ``opt`` (a default with the metadata the parser and
``--help`` read) and the value rules the groups share."""

from __future__ import annotations

import re
from dataclasses import field
from typing import Any

from twinkle.runtime.runtime import MAX_SEED

AT_LEAST_1 = (lambda v: v >= 1, ">= 1")
AT_LEAST_0 = (lambda v: v >= 0, ">= 0")
POSITIVE = (lambda v: v > 0, "> 0")
# torch.manual_seed takes a seed below 2**64, and each rank of a distributed run seeds itself with
# seed + 1_000_003 * rank: a seed below 2**63 leaves that offset room for any number of ranks.
SEED = (
    lambda v: 0 <= v <= MAX_SEED,
    f"in [0, {MAX_SEED}] (2**63 - 1: torch seeds are 64-bit and each rank adds an offset)",
)
# PEFT makes the adapter name a module name (no '.', not empty); names limited to these characters
# also stay valid in the checkpoint's state-dict keys and in file and log names.
ADAPTER_NAME_RE = re.compile(r"[A-Za-z0-9_-]+")
ADAPTER_NAME = (
    lambda v: ADAPTER_NAME_RE.fullmatch(v) is not None,
    "a name of letters, digits, '_' and '-' (PEFT makes it a module name, which cannot hold '.')",
)


def opt(
    default: Any,
    help: str,
    *,
    choices: tuple[str, ...] | None = None,
    check: tuple | None = None,
    flag: str | None = None,
    aliases: tuple[str, ...] = (),
) -> Any:
    """Declare a field with the metadata the parser and ``--help`` read."""
    meta = {"help": help, "choices": choices, "check": check, "flag": flag, "aliases": aliases}
    return field(default=default, metadata=meta)
