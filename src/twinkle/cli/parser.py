"""Turn defaults, config files, ``TWINKLE_`` env vars and flags into one ``Args``.

Precedence, lowest first: dataclass defaults < ``env_file=`` (a dotenv file a script names) <
``config_file=`` < ``--config FILE`` < ``TWINKLE_<FIELD>`` env vars < command-line flags. We do
not use ``argparse`` because the contract needs things it does not do cleanly: unknown flags land
in ``Args.extra`` instead of failing, every bool has a ``--no-`` form, and a bad value must be
one ``UserError`` line naming the flag (argparse prints usage and exits itself). Only the
``TWINKLE_`` prefix is read from the environment (and from a dotenv file) so that launcher
variables (``WORLD_SIZE``, ``PORT``, ``RANK`` ...) can never silently change a hyper-parameter.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

from .args import FIELD_GROUP, GROUPS, UNSUPPORTED_GROUPS, Args
from .fields import BOOL_WORDS, EXPECTED, FLAGS, SPECS, coerce, guess_scalar, lookup_flag

ENV_PREFIX = "TWINKLE_"
# Unknown keys the cookbook reads from ``args.extra``; any other unknown flag earns a warning,
# because it is most often a typo of a real flag.
KNOWN_EXTRA: dict[str, str] = {
    "model_name": "name the model calls itself (SelfCognitionProcessor)",
    "model_author": "author the model names (SelfCognitionProcessor)",
    "data_format": "messages or alpaca: the rows of --dataset-id (cookbook/transformers/sft_own_data.py)",
    # cookbook/transformers/multi_lora.py: one comma-separated entry per identity
    "adapters": "adapter names, e.g. twinkle,pip (cookbook/transformers/multi_lora.py)",
    "model_names": "each identity's name, e.g. Twinkle,Pip (multi_lora.py)",
    "model_authors": "each identity's author, e.g. ModelScope,Acme Labs (multi_lora.py)",
    "ranks": "each adapter's LoRA rank, e.g. 8,16 (multi_lora.py)",
    "optimizers": "each adapter's torch.optim class, e.g. Muon,AdamW (multi_lora.py)",
}


def parse_argv(argv: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any], str | None]:
    """Flags -> (typed field values, extra, config path). Later repeats of a flag win."""
    values: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    config: str | None = None
    i = 0
    while i < len(argv):
        tok = argv[i]
        i += 1
        name, has_eq, inline = tok[2:].partition("=")
        if not tok.startswith("--") or not name:
            raise UserError(f"unexpected argument {tok!r}: options are written --name value (see --help)")
        nxt = argv[i] if i < len(argv) else None
        field_name, negated = lookup_flag(name)
        if name == "config" or (field_name is not None and SPECS[field_name].kind is not bool):
            if has_eq:
                raw = inline
            elif nxt is None or nxt.startswith("--"):
                kind = "a file path" if name == "config" else EXPECTED[SPECS[field_name].kind]
                raise UserError(f"{tok}: expected {kind} after the flag")
            else:
                raw, i = nxt, i + 1
            if name == "config":
                config = raw
            else:
                values[field_name] = coerce(SPECS[field_name], raw, "--" + name)
        elif field_name is not None:  # boolean field
            if has_eq and negated:
                raise UserError(f"--{name}: takes no value (use --{name[3:]}={inline})")
            if has_eq:
                raw = inline
            elif not negated and nxt is not None and nxt.strip().lower() in BOOL_WORDS:
                raw, i = nxt, i + 1
            else:
                raw = not negated
            values[field_name] = coerce(SPECS[field_name], raw, "--" + name)
        elif name.startswith("no-") and name[3:].replace("_", "-") in FLAGS:
            spec = SPECS[FLAGS[name[3:].replace("_", "-")]]
            none = f" (or --{spec.flag} none)" if spec.optional else ""
            raise UserError(
                f"--{name}: only boolean flags take a no- prefix; write --{spec.flag} VALUE{none}"
            )
        else:
            key = name.replace("-", "_")
            if has_eq:
                extra[key] = guess_scalar(inline)
            elif nxt is not None and not nxt.startswith("--"):
                extra[key], i = guess_scalar(nxt), i + 1
            elif key.startswith("no_") and len(key) > 3:
                extra[key[3:]] = False
            else:
                extra[key] = True
    return values, extra, config


def read_env(env: Mapping[str, str], where: str = "") -> dict[str, Any]:
    """``TWINKLE_<FLAG>`` (a field name or any of its flag names, e.g. ``TWINKLE_LR``) -> typed
    values. Other names, and empty values, are ignored. ``where`` prefixes error labels."""
    values: dict[str, Any] = {}
    for key, raw in env.items():
        if not key.startswith(ENV_PREFIX) or raw == "":
            continue
        field = FLAGS.get(key[len(ENV_PREFIX) :].lower().replace("_", "-"))
        spec = SPECS.get(field) if field else None
        if spec is not None:
            values[spec.name] = coerce(spec, raw, f"{where}{key} (--{spec.flag})")
    return values


def read_env_file(path: str) -> dict[str, str]:
    """A dotenv file -> ``{KEY: VALUE}``: ``KEY=VALUE`` lines, optionally ``export KEY=VALUE``;
    blank lines and ``#`` comments are skipped; a value in matching quotes is taken verbatim, an
    unquoted one ends at `` #``."""
    label = f"env_file {path}"
    out: dict[str, str] = {}
    for number, line in enumerate(_read_text(path, "env_file").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, has_eq, value = line.removeprefix("export ").partition("=")
        key, value = key.strip(), value.strip()
        if not has_eq or not key.isidentifier():
            raise UserError(f"{label}, line {number}: expected KEY=VALUE, got {line!r}")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        else:
            value = value.split(" #", 1)[0].rstrip()
        out[key] = value
    return out


def _read_text(path: str, label: str) -> str:
    try:
        return Path(path).expanduser().read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{label}: file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{label}: cannot read {path}: {exc}") from None


def _parse_config_text(path: str, text: str, label: str) -> Any:
    """JSON for a ``.json`` file, YAML (a superset of JSON) for anything else."""
    if Path(path).suffix.lower() == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"{label}: {path} is not valid JSON at line {exc.lineno}: {exc.msg}") from None
    try:
        import yaml
    except ImportError as exc:  # pragma: no cover - pyyaml is a core dependency
        raise UserError(
            f"{label}: a YAML config needs PyYAML (pip install pyyaml), or use a .json file"
        ) from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise UserError(f"{label}: {path} is not valid YAML{where}: {problem}") from None


def load_config(path: str, label: str = "--config") -> tuple[dict[str, Any], dict[str, Any]]:
    """A YAML or JSON mapping, flat or grouped by group name, -> (typed field values, extra).

    Keys are field or flag names; an ``extra:`` mapping, and the cookbook's own keys
    (``KNOWN_EXTRA``), go to ``Args.extra``. Any other key is a typo until proven otherwise."""
    data = _parse_config_text(path, _read_text(path, label), label)
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise UserError(f"{label}: {path} must be a mapping of option: value, got {type(data).__name__}")
    values: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    where = f"{label} {path}"
    for key, val in data.items():
        norm = str(key).replace("-", "_")
        if norm in GROUPS or norm == "extra":
            if not isinstance(val, dict):
                raise UserError(f"{where}: '{key}' must be a mapping, got {type(val).__name__}")
            for sub_key, sub_val in val.items():
                if norm == "extra":
                    extra[str(sub_key).replace("-", "_")] = sub_val
                else:
                    _config_item(where, str(sub_key), sub_val, norm, values, extra)
        elif norm in UNSUPPORTED_GROUPS and isinstance(val, dict):
            raise UserError(f"{where}: not supported yet: the '{key}' group ({UNSUPPORTED_GROUPS[norm]})")
        else:
            _config_item(where, str(key), val, None, values, extra)
    return values, extra


def _config_item(where: str, key: str, val: Any, group: str | None, values: dict, extra: dict) -> None:
    field_name, _ = lookup_flag(key)
    if field_name is None:
        norm = key.replace("-", "_")
        if norm in KNOWN_EXTRA:
            extra[norm] = val
            return
        nearest = difflib.get_close_matches(norm, list(SPECS), n=1, cutoff=0.0)
        raise UserError(
            f"{where}: unknown key '{key}' (nearest field: {nearest[0]}); "
            "put a script's own keys under 'extra:'"
        )
    if group is not None and FIELD_GROUP[field_name] != group:
        raise UserError(f"{where}: '{key}' belongs to group '{FIELD_GROUP[field_name]}', not '{group}'")
    values[field_name] = coerce(SPECS[field_name], val, f"{where}: {key}")


def parse(
    argv: Sequence[str],
    env: Mapping[str, str],
    config_file: str | None = None,
    env_file: str | None = None,
) -> Args:
    """Merge every source into a fresh ``Args``; raises ``UserError`` on the first bad value."""
    cli_values, cli_extra, config = parse_argv(argv)
    values: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    if env_file is not None:
        values.update(read_env(read_env_file(str(env_file)), where=f"env_file {env_file}: "))
    for path, label in ((config_file, "config_file"), (config, "--config")):
        if path is not None:
            file_values, file_extra = load_config(str(path), label)
            values.update(file_values)
            extra.update(file_extra)
    values.update(read_env(env))
    values.update(cli_values)
    extra.update(cli_extra)
    args = Args(extra=extra)
    for name, value in values.items():
        setattr(getattr(args, FIELD_GROUP[name]), name, value)
    _warn(args, cli_extra)
    _check_model_cls(args.model.model_cls)
    from twinkle.optim.optimizer import resolve_optimizer_cls

    resolve_optimizer_cls(args.optimizer.optimizer_cls, "--optimizer-cls")  # refused before any data is read
    from twinkle.checkpoint import check_output_dir, latest_checkpoint

    check_output_dir(args.training.output_dir)  # fail now, not at the first save hours later
    args.resume_request = args.training.resume_from_checkpoint
    if args.training.resume_from_checkpoint in ("auto", "latest"):
        found = latest_checkpoint(args.training.output_dir)
        get_logger().info(
            f"--resume-from-checkpoint {args.training.resume_from_checkpoint}: "
            + (
                f"resuming from {found}"
                if found
                else f"no complete checkpoint under {args.training.output_dir}; starting fresh"
            )
        )
        args.training.resume_from_checkpoint = str(found) if found else None
    return args


# ``--model-cls`` names the training can use: a class whose forward ends in a language-model head
# (AutoModelForCausalLM and every *ForCausalLM end in "ForCausalLM"; multimodal chat models such
# as Qwen3_5ForConditionalGeneration in "ForConditionalGeneration"). AutoModel or *Model classes
# return hidden states only.
LM_HEAD_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration")


def _check_model_cls(name: str | None) -> None:
    """A typo in ``--model-cls``, or a class without a language-model head, fails before any
    weight is read. The names come from the installed transformers' own index (nothing is
    imported per name, nothing downloaded)."""
    if name is None:
        return
    import transformers

    names = dir(transformers)
    if name not in names:
        close = difflib.get_close_matches(name, names, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else "; e.g. AutoModelForCausalLM"
        raise UserError(f"--model-cls: transformers has no class {name!r}{hint}")
    if not name.endswith(LM_HEAD_SUFFIXES):
        raise UserError(
            f"--model-cls: {name} has no language-model head to train (the loss needs its logits); "
            "use AutoModelForCausalLM, a *ForCausalLM class or a multimodal *ForConditionalGeneration "
            "class such as Qwen3_5ForConditionalGeneration"
        )


def _warn(args: Args, cli_extra: dict[str, Any]) -> None:
    """Say so when an option will be ignored, rather than letting it pass silently."""
    logger = get_logger()
    for key in cli_extra:
        if key not in KNOWN_EXTRA:
            close = difflib.get_close_matches(key.replace("_", "-"), list(FLAGS), n=1)
            hint = f" (did you mean --{close[0]}?)" if close else ""
            logger.warning(f"unknown flag --{key.replace('_', '-')} kept in args.extra{hint}")
    if args.training.resume_from_checkpoint is None:
        for name in ("resume_only_model", "ignore_data_skip"):
            if getattr(args.training, name):
                logger.warning(f"--{name.replace('_', '-')} is ignored without --resume-from-checkpoint")
