"""``twinkle eval --adapter CKPT [--dataset-id ID] [--eval-samples N]``: the eval loss and
token accuracy of a checkpoint, computed as the training script's ``evaluate`` does
(``forward_only`` + ``calculate_loss`` per batch, then ``calculate_metric(is_training=False)``).
The loss is the one the checkpoint was trained with, rebuilt with its arguments
(``twinkle.cli.from_checkpoint``); a checkpoint trained with a preference loss is evaluated on
held-out preference pairs instead: its loss, reward accuracy and reward margin
(``twinkle.cli.evaluate_pairs``).

The rows go through the training pipeline: the self-cognition preprocessor and the template
with its max length and truncation. Their settings, and the base model, come from the run that
wrote the checkpoint (``run_args.json`` next to it, written with ``metrics.jsonl``; the base
model also from the checkpoint's ``trainer_state.json``); a flag given here wins."""

import argparse
import json
from pathlib import Path
from typing import Any

from twinkle.checkpoint.layout import TRAINER_STATE, parse_trainer_state
from twinkle.cli.evaluate_pairs import evaluate_pairs, print_pair_metrics
from twinkle.cli.from_checkpoint import checkpoint_model, trained_loss
from twinkle.cli.identity_check import add_identity_check_args, run_identity_check
from twinkle.utils.errors import UserError

DEFAULT_SAMPLES = 100  # the contract's eval default


def add_eval_parser(sub: Any) -> None:
    p = sub.add_parser("eval", help="eval loss and accuracy of a checkpoint on a dataset")
    p.add_argument("--adapter", required=True, help="a checkpoint folder written by model.save(...)")
    p.add_argument("--model-id", help="base model (default: the one the checkpoint was trained on)")
    p.add_argument("--dataset-id", help="dataset path or id (default: the training run's, else bundled)")
    p.add_argument(
        "--eval-samples",
        type=int,
        help=f"rows to evaluate (default: {DEFAULT_SAMPLES}); pairs for a checkpoint of a preference loss "
        "(default: the run's held-out pairs)",
    )
    p.add_argument("--batch-size", type=int, help="rows per batch (default: the training run's, else 4)")
    p.add_argument("--template-cls", help="template class (default: the training run's)")
    p.add_argument("--max-length", type=int, help="maximum tokens per row (default: the training run's)")
    p.add_argument("--model-name", help="SelfCognitionProcessor's model name (default: the training run's)")
    p.add_argument("--model-author", help="SelfCognitionProcessor's author (default: the training run's)")
    add_identity_check_args(p)


# The settings ``twinkle eval`` takes from a run's ``run_args.json``, by group, with their types.
_USED = {
    "dataset": {"dataset_id": str, "split": str},
    "template": {"template_cls": str, "max_length": int, "truncation_strategy": str},
    "model": {"model_id": str},
    "training": {"eval_samples": int, "batch_size": int},
    "extra": {"model_name": str, "model_author": str},
    "loss": {"beta": float, "loss_type": str, "sft_weight": float, "label_smoothing": float},
}
_RUN_ARGS_FIX = "restore it, or remove it and give the settings as flags (twinkle eval --help)"


def read_run_args(path: Path) -> dict[str, Any]:
    """The settings ``twinkle eval`` uses from ``path`` (a run's ``run_args.json``), flat; a
    ``UserError`` naming the file when it is empty, not JSON, not an object, or holds a setting
    of the wrong type (a hand edit or a damaged disk)."""
    try:
        text = path.read_text(encoding="utf-8")
        run = json.loads(text) if text.strip() else None
    except OSError as exc:
        raise UserError(f"cannot read {path} ({exc.strerror or exc}); {_RUN_ARGS_FIX}") from None
    except (ValueError, RecursionError) as exc:
        reason = " ".join(str(exc).split())[:120] or type(exc).__name__
        raise UserError(f"{path} is not valid JSON ({reason}); {_RUN_ARGS_FIX}") from None
    if run is None:
        raise UserError(f"{path} is empty; {_RUN_ARGS_FIX}")
    if not isinstance(run, dict):
        raise UserError(
            f"{path} holds a JSON {type(run).__name__}, not the object a run writes; {_RUN_ARGS_FIX}"
        )
    found: dict[str, Any] = {}
    for group, fields in _USED.items():
        values = run.get(group, {})
        if not isinstance(values, dict):
            raise UserError(f"{path}: {group!r} is {_kind(values)}, not an object; {_RUN_ARGS_FIX}")
        for name, kind in fields.items():
            value = values.get(name)
            accepted = (int, float) if kind is float else kind  # JSON writes 1.0 as 1 too
            if value is not None and (not isinstance(value, accepted) or isinstance(value, bool)):
                raise UserError(
                    f"{path}: {group}.{name} is {_kind(value)}, not {kind.__name__}; {_RUN_ARGS_FIX}"
                )
            if kind is int and value is not None and value < 1:
                raise UserError(f"{path}: {group}.{name} is {value}, not a positive count; {_RUN_ARGS_FIX}")
            if value is not None:
                found[name] = value
    return found


def _kind(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {json.dumps(value)[:40]}"


def training_settings(folder: Path) -> dict[str, Any]:
    """The settings of the run that wrote ``folder``: its ``run_args.json`` (in the folder or
    its parent, the output dir), with the base model of its ``trainer_state.json``."""
    found: dict[str, Any] = {}
    for candidate in (folder / "run_args.json", folder.parent / "run_args.json"):
        if candidate.is_file():
            found = read_run_args(candidate)
            break
    if found.get("model_id") is None and (folder / TRAINER_STATE).is_file():
        found["model_id"] = parse_trainer_state(folder).get("model_path")
    return found


def run_eval(args: argparse.Namespace) -> int:
    folder = Path(args.adapter).expanduser()
    if not (folder / "adapter_config.json").is_file():
        raise UserError(
            f"{folder} holds no adapter (adapter_config.json); pass a checkpoint folder to --adapter"
        )
    from twinkle.hub import check_adapter_folder

    check_adapter_folder(folder)  # its config and tensors agree (rank r), before any model loads
    saved = training_settings(folder)

    def pick(name: str, default: Any) -> Any:
        value = getattr(args, name, None)
        return value if value is not None else saved.get(name) if saved.get(name) is not None else default

    if args.identity_check:
        return run_identity_check(args, folder, pick)
    pipeline = {  # the rows' way into the model, as the run had it
        "model_id": pick("model_id", None),
        "dataset_id": pick("dataset_id", None),
        "batch_size": pick("batch_size", 4),
        "template_cls": pick("template_cls", "Template"),
        "max_length": pick("max_length", 1024),
        "truncation_strategy": saved.get("truncation_strategy", "right"),
        "model_name": pick("model_name", "twinkle大模型"),
        "model_author": pick("model_author", "ModelScope社区"),
    }
    loss = trained_loss(folder, saved)  # built first: a loss that cannot be rebuilt stops here
    if is_preference(loss):
        return _eval_pairs(args, folder, saved, pipeline, loss)
    if loss is not None and loss.extra_inputs:
        raise UserError(
            f"{folder} was trained with {loss.name}, which reads {', '.join(loss.extra_inputs)} besides "
            "the rows; twinkle eval evaluates a loss of held-out rows or preference pairs alone"
        )
    samples = pick("eval_samples", DEFAULT_SAMPLES)
    if samples < 1:
        raise UserError(f"--eval-samples must be at least 1, got {samples}")
    metrics = evaluate_checkpoint(folder, samples=samples, loss=loss, **pipeline)
    print(
        f"eval loss {metrics['loss']:.4f}, accuracy {metrics['accuracy']:.4f} "
        f"({metrics['samples']} samples, {metrics['supervised_tokens']} supervised tokens)",
        flush=True,
    )
    return 0


def is_preference(loss: Any) -> bool:
    """A loss over interleaved (chosen, rejected) pairs of rows (``twinkle.loss.preference``)."""
    if loss is None:
        return False
    from twinkle.loss import PreferenceLoss

    return isinstance(loss, PreferenceLoss)


def evaluate_checkpoint(
    folder: Path,
    model_id: str | None,
    dataset_id: str | None,
    samples: int,
    batch_size: int,
    template_cls: str,
    max_length: int,
    truncation_strategy: str,
    model_name: str,
    model_author: str,
    loss: Any = None,
) -> dict[str, float]:
    """The eval metrics of ``folder``'s adapter on the first ``samples`` rows of ``dataset_id``
    with ``loss`` (None: the model's default loss)."""
    from twinkle.dataloader import DataLoader
    from twinkle.dataset import Dataset, DatasetMeta
    from twinkle.preprocessor import SelfCognitionProcessor

    model = checkpoint_model(folder, model_id)
    if loss is not None:
        model.set_loss(loss)
    # never more rows than the set holds: a row counted twice would weigh double
    samples = min(samples, len(Dataset(dataset_meta=DatasetMeta(dataset_id))))
    dataset = Dataset(dataset_meta=DatasetMeta(dataset_id, data_slice=range(samples)))
    dataset.set_template(
        template_cls, model_id=model_id, max_length=max_length, truncation_strategy=truncation_strategy
    )
    dataset.map(SelfCognitionProcessor(model_name, model_author))
    dataset.encode()
    for batch in DataLoader(dataset=dataset, batch_size=batch_size):
        model.forward_only(inputs=batch)
        model.calculate_loss()
    return model.calculate_metric(is_training=False)


def _eval_pairs(
    args: argparse.Namespace, folder: Path, saved: dict[str, Any], pipeline: dict[str, Any], loss: Any
) -> int:
    pairs = args.eval_samples if args.eval_samples is not None else saved.get("eval_samples")
    if pairs is not None and pairs < 1:
        raise UserError(f"--eval-samples must be at least 1, got {pairs}")
    metrics = evaluate_pairs(folder, loss=loss, split=saved.get("split"), pairs=pairs, **pipeline)
    print_pair_metrics(metrics)
    return 0
