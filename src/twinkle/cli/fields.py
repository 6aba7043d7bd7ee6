"""Field specs derived from the ``Args`` dataclasses, and value conversion/validation.

Every source (flag, env var, YAML) goes through ``coerce`` so that the same value is accepted
or rejected the same way wherever it comes from, and the error names where it came from.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass
from typing import Any

from twinkle.template.registry import refuse_not_yet
from twinkle.utils.errors import UserError

from .args import GROUPS, split_target_modules

_TRUE = frozenset({"true", "1", "yes", "y", "on"})
_FALSE = frozenset({"false", "0", "no", "n", "off"})
BOOL_WORDS = _TRUE | _FALSE
_NONE = frozenset({"none", "null"})
_INT_RE = re.compile(r"[+-]?[0-9]+", re.ASCII)
_PLAIN_INT_RE = re.compile(r"[+-]?(0|[1-9][0-9]*)", re.ASCII)  # no leading zeros: '007' is a name
_FLOAT_RE = re.compile(r"[+-]?([0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)([eE][+-]?[0-9]+)?", re.ASCII)
EXPECTED = {
    int: "an integer",
    float: "a number",
    bool: "a boolean (true/false, 1/0, yes/no)",
    str: "a string",
}


@dataclass(frozen=True)
class FieldSpec:
    """What the parser needs to know about one field, derived once from the dataclasses."""

    name: str
    group: str
    kind: type
    optional: bool
    default: Any
    help: str
    choices: tuple[str, ...] | None
    check: tuple | None
    flag: str
    aliases: tuple[str, ...]

    @property
    def type_name(self) -> str:
        return self.kind.__name__ + ("|none" if self.optional else "")


def _build_specs() -> dict[str, FieldSpec]:
    specs: dict[str, FieldSpec] = {}
    for group, cls in GROUPS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            members = typing.get_args(hints[f.name]) or (hints[f.name],)
            kinds = [m for m in members if m is not type(None)]
            assert len(kinds) == 1 and kinds[0] in EXPECTED, f"unsupported type for {f.name}"
            meta = f.metadata
            flag = meta.get("flag") or f.name.replace("_", "-")
            specs[f.name] = FieldSpec(
                name=f.name,
                group=group,
                kind=kinds[0],
                optional=type(None) in members,
                default=f.default,
                help=meta.get("help", ""),
                choices=meta.get("choices"),
                check=meta.get("check"),
                flag=flag,
                aliases=tuple(meta.get("aliases", ())),
            )
    return specs


SPECS: dict[str, FieldSpec] = _build_specs()


def _build_flags() -> dict[str, str]:
    flags: dict[str, str] = {}
    for spec in SPECS.values():
        for name in {spec.flag, spec.name.replace("_", "-"), *spec.aliases}:
            assert flags.get(name, spec.name) == spec.name, f"flag --{name} maps to two fields"
            flags[name] = spec.name
    return flags


# Flag name without dashes -> field name (primary names, field-name spellings and aliases).
FLAGS: dict[str, str] = _build_flags()


def coerce(spec: FieldSpec, value: Any, label: str) -> Any:
    """Convert a raw string (flag, env) or YAML scalar to the field's type, then validate it."""
    if value is None or (isinstance(value, str) and spec.optional and value.strip().lower() in _NONE):
        if spec.optional:
            return None
        raise UserError(f"{label}: expected {EXPECTED[spec.kind]}, got none")
    out = _convert(spec, value, label)
    if spec.name == "template_cls":
        refuse_not_yet(out)  # a name upstream's cookbooks use for what is not built: say what
    if spec.choices is not None and out not in spec.choices:
        raise UserError(f"{label}: {out!r} is not one of {', '.join(spec.choices)}")
    if spec.check is not None and not spec.check[0](out):
        raise UserError(f"{label}: must be {spec.check[1]}, got {out!r}")
    if spec.name == "target_modules" and not split_target_modules(out):
        raise UserError(f"{label}: expected 'all-linear' or comma-separated module names, got {out!r}")
    if spec.name == "padding_free" and out is False:
        # Packing changes no number (the loss is the padded batch's), so there is nothing to turn off.
        raise UserError(
            f"{label}: batches always run padding-free where the model allows it (same loss as padded); drop the option"
        )
    return out


def _convert(spec: FieldSpec, value: Any, label: str) -> Any:
    kind, text = spec.kind, value.strip() if isinstance(value, str) else None
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if text is not None and text.lower() in BOOL_WORDS:
            return text.lower() in _TRUE
    elif kind is int and not isinstance(value, bool):
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if text is not None and _INT_RE.fullmatch(text):
            return int(text)
    elif kind is float and not isinstance(value, bool):
        if isinstance(value, int | float):
            return float(value)
        if text is not None and _FLOAT_RE.fullmatch(text):
            return float(text)
    elif kind is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        if spec.name == "target_modules" and isinstance(value, list):
            return ",".join(str(v) for v in value)
    raise UserError(f"{label}: expected {EXPECTED[kind]}, got {value!r}")


def guess_scalar(text: str) -> Any:
    """Type an ``extra`` value only when it is unambiguous; names like '007' stay strings."""
    if _PLAIN_INT_RE.fullmatch(text):
        return int(text)
    if _FLOAT_RE.fullmatch(text) and not _INT_RE.fullmatch(text):
        return float(text)
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def lookup_flag(name: str) -> tuple[str | None, bool]:
    """Flag name -> (field, negated). ``--no-X`` negates only boolean fields."""
    name = name.replace("_", "-")
    if name in FLAGS:
        return FLAGS[name], False
    if name.startswith("no-") and FLAGS.get(name[3:]) and SPECS[FLAGS[name[3:]]].kind is bool:
        return FLAGS[name[3:]], True
    return None, False
