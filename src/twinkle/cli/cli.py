"""``CLI.from_args()``: the one call a training script makes to get its ``Args``.

A script run by a person should fail on a typo with one readable line and exit status 2 (the
convention for usage errors), not a traceback from deep inside the parser. Tests pass ``argv``
explicitly and get the ``UserError`` instead, so they can assert on it.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path

from twinkle.distributed.collectives import peer_lost
from twinkle.metric.sinks import parse_report_to
from twinkle.model.options import STRATEGIES
from twinkle.runtime import RunDefaults, hand_over
from twinkle.utils.errors import INTERRUPTED, UserError

from .args import GROUPS, Args
from .fields import SPECS, FieldSpec
from .parser import ENV_PREFIX, KNOWN_EXTRA, parse


class CLI:
    """Namespace for the parsing entry point; it holds no state of its own."""

    @staticmethod
    def from_args(
        argv: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        config_file: str | os.PathLike | None = None,
        env_file: str | os.PathLike | None = None,
    ) -> Args:
        """Parse ``argv`` (default ``sys.argv[1:]``) and ``env`` (default ``os.environ``).

        ``config_file``: a YAML or JSON file of defaults the script ships (a ``--config`` on the
        command line is read after it, so its values win). ``env_file``: a dotenv file of
        ``TWINKLE_<FIELD>=value`` lines, read below every other source; it is never copied into
        ``os.environ``. Precedence, lowest first: defaults < env_file < config_file < --config <
        environment < flags.

        ``-h``/``--help`` prints the usage and exits 0. Parsing changes nothing in the process:
        the values a run needs beyond the script's own calls (seed, process-group timeout, dtype,
        activation checkpointing, gradient clipping, model class, skip-bad-rows, the output dir
        and its metric sinks) are handed over as a ``RunDefaults`` (``twinkle.runtime.hand_over``),
        which ``twinkle.initialize()`` applies; so is the hook that prints a ``UserError`` as one
        line, for a command line read from ``sys.argv`` without ``--debug``.
        """
        if isinstance(env, str | os.PathLike):
            raise UserError(
                "CLI.from_args: the second argument is env, a mapping of variables; pass a dotenv file as env_file=..."
            )
        from_sys = argv is None
        argv = list(sys.argv[1:] if argv is None else argv)
        env = os.environ if env is None else env
        if "-h" in argv or "--help" in argv:
            print(format_help(Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "train.py"))
            raise SystemExit(0)
        try:
            args = parse(
                argv,
                env,
                config_file=None if config_file is None else os.fspath(config_file),
                env_file=None if env_file is None else os.fspath(env_file),
            )
        except UserError as exc:
            if not from_sys:
                raise
            if "--debug" in argv:
                traceback.print_exc()
            message = " ".join(str(exc).split())  # guarantee a single line
            print(f"error: {message}", file=sys.stderr)
            sys.exit(2)
        try:
            check_output_dir_use(args)
            defaults = run_defaults_of(args)
        except UserError as exc:
            if not from_sys:
                raise
            print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
            sys.exit(2)
        hook = (_full_tracebacks if args.infra.debug else _one_line_user_errors) if from_sys else None
        hand_over(defaults, hook)
        return args


def check_output_dir_use(args: Args) -> None:
    """Before training: ``--output-dir`` must not overlap a local ``--dataset-id`` (equal, inside
    it, or holding it), or the run would read its own checkpoints as data, or write over the
    data; and no run file there may be a link (``check_run_files``)."""
    from twinkle.hub.dataset import BUNDLED_DATASET_NAMES
    from twinkle.metric.report import check_run_files

    output, data = args.training.output_dir, args.dataset.dataset_id
    check_run_files(output)
    if data is None or data in BUNDLED_DATASET_NAMES or not Path(data).expanduser().exists():
        return
    out = Path(os.path.realpath(Path(output).expanduser()))
    source = Path(os.path.realpath(Path(data).expanduser()))
    if out.is_relative_to(source) or source.is_relative_to(out):
        how = "is" if out == source else "is inside" if out.is_relative_to(source) else "holds"
        raise UserError(
            f"--output-dir {output} overlaps --dataset-id {data} (the output folder {how} the "
            "dataset, so checkpoints would be read as data or data overwritten); choose an output "
            "folder outside the dataset"
        )


def run_defaults_of(args: Args) -> RunDefaults:
    """The run configuration of a parsed command line (``twinkle.runtime.run_config``)."""
    return RunDefaults(
        seed=args.infra.seed,
        process_group_timeout_s=args.infra.process_group_timeout,
        dtype=args.model.dtype,
        activation_checkpointing=args.model.activation_checkpointing,
        strategy=STRATEGIES[args.model.strategy],  # upstream's names -> ours (native_fsdp is fsdp)
        output_dir=args.training.output_dir,
        lock_output_dir=True,
        max_restarts=args.infra.max_restarts,
        ray_address=args.infra.ray_address,
        ray_placement=args.infra.ray_placement,
        max_grad_norm=args.optimizer.max_grad_norm,
        model_cls=args.model.model_cls,
        skip_bad_rows=args.dataset.skip_bad_rows,
        report_to=parse_report_to(args.training.report_to),
        resuming=args.training.resume_from_checkpoint is not None,
        run_args=args.to_dict(),
    )


def _full_tracebacks(kind, exc, tb):  # noqa: ANN001 - the sys.excepthook signature
    """``--debug``: every uncaught exception, a ``UserError`` included, prints its traceback (a hook
    of Twinkle's own, so the one-line hook of ``twinkle.utils.errors`` stays out)."""
    sys.__excepthook__(kind, exc, tb)


def _one_line_user_errors(kind, exc, tb):  # noqa: ANN001 - the sys.excepthook signature
    """A script run from the command line reports a ``UserError`` as one line (``--debug`` shows
    the traceback), and so is a collective cut off by the death of another rank: that rank's own
    exit is the cause, and this one's traceback would only bury it. Every other exception keeps
    its traceback. Ctrl-C (``KeyboardInterrupt``) is one line too, and the process then ends by
    SIGINT as Python does (exit status 130 in a shell). The run's summary is logged first, so the
    ``error:`` line is the last one."""
    if isinstance(exc, UserError | KeyboardInterrupt) or peer_lost(exc):
        from twinkle.metric import report

        report.finish()
    if isinstance(exc, KeyboardInterrupt):
        print(f"error: {INTERRUPTED}", file=sys.stderr)
    elif isinstance(exc, UserError):
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
    elif peer_lost(exc):
        first = " ".join(str(exc).split("\n")[0].split())[:200]
        print(
            f"error: another rank of this job stopped during a collective ({first}); relaunch with "
            "--resume-from-checkpoint auto to continue from the last complete checkpoint",
            file=sys.stderr,
        )
    else:
        sys.__excepthook__(kind, exc, tb)


def _flag_column(spec: FieldSpec) -> str:
    names = [spec.flag, *(a for a in spec.aliases if a != spec.flag)]
    if spec.kind is bool:
        return ", ".join([f"--{n}" for n in names] + [f"--no-{n}" for n in names])
    if spec.choices:
        return f"{', '.join('--' + n for n in names)} {{{','.join(spec.choices)}}}"
    return f"{', '.join('--' + n for n in names)} {spec.type_name.upper()}"


def format_help(prog: str = "train.py") -> str:
    """Usage text, grouped like ``Args``, generated from the dataclasses so it cannot drift."""
    lines = [
        f"usage: {prog} [--config FILE] [--flag VALUE ...]",
        "",
        "Values come from, lowest precedence first: the defaults below < --config FILE (YAML or",
        "JSON, flat {batch_size: 8} or grouped {training: {batch_size: 8}}; unknown keys are an",
        f"error) < environment variables {ENV_PREFIX}<FIELD> (e.g. {ENV_PREFIX}BATCH_SIZE=8; only this",
        "prefix is read, so WORLD_SIZE, PORT, RANK... never change an option) < command-line flags.",
        "A script may add CLI.from_args(config_file=..., env_file=...): both sit below --config.",
        "Write --flag value or --flag=value; booleans take --flag, --no-flag or --flag true|false;",
        "optional values accept 'none'.",
    ]
    for group in GROUPS:
        lines += ["", f"{group}:"]
        for spec in (s for s in SPECS.values() if s.group == group):
            lines.append(f"  {_flag_column(spec)}")
            lines.append(f"      {spec.help} [{spec.type_name}, default: {spec.default!r}]")
    lines += ["", "extra (any unknown --flag lands in args.extra, '-' -> '_'); the cookbook reads:"]
    for key, text in KNOWN_EXTRA.items():
        lines.append(f"  --{key.replace('_', '-')} TEXT")
        lines.append(f"      {text} [args.extra['{key}']]")
    return "\n".join(lines)
