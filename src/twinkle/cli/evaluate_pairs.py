"""``twinkle eval`` of a checkpoint trained with a preference loss (``twinkle.loss.preference``:
``DPOLoss``, ``SimPOLoss``, ``CPOLoss``, ``ORPOLoss``, ...): the loss and ``DPOMetric`` of held-out
preference pairs, evaluated as ``cookbook/rl/dpo_lora.py`` does, with the base model (the adapter
off) as the reference of a loss that reads one.

The pairs: the bundled ``self-cognition-dpo`` set's ``eval`` split, or the first
``--eval-samples`` pairs of a set of your own (``--dataset-id``, the rows the cookbook held out).
The loss is the checkpoint's own, with its arguments (``twinkle.cli.from_checkpoint``)."""

from pathlib import Path
from typing import Any

from twinkle.cli.from_checkpoint import checkpoint_model
from twinkle.utils.errors import UserError

BUNDLED = "self-cognition-dpo"


def evaluate_pairs(
    folder: Path,
    loss: Any,
    model_id: str | None,
    dataset_id: str | None,
    split: str | None,
    pairs: int | None,
    batch_size: int,
    template_cls: str,
    max_length: int,
    truncation_strategy: str,
    model_name: str,
    model_author: str,
) -> dict[str, float]:
    """The eval loss and ``DPOMetric`` numbers of ``loss`` (a preference loss) on ``pairs``
    held-out pairs (None: the bundled ``eval`` split whole) of ``dataset_id`` (None: the bundled
    set). The reward metrics need a reference: they are there when the loss reads one."""
    from twinkle.dataloader import DataLoader
    from twinkle.dataset import Dataset, DatasetMeta
    from twinkle.metric import DPOMetric
    from twinkle.preprocessor import PreferenceProcessor, SelfCognitionDPOProcessor

    if (dataset_id or BUNDLED) == BUNDLED:
        dataset_id, split = BUNDLED, "eval"
        processor: Any = SelfCognitionDPOProcessor(model_name, model_author)
    elif pairs is None:
        raise UserError(
            f"the run held no pair of {dataset_id} out; pass --eval-samples N to evaluate its first N pairs"
        )
    else:
        split = split or "train"
        processor = PreferenceProcessor()
    if pairs is not None:  # never more than the set holds: a pair counted twice would weigh double
        pairs = min(pairs, len(Dataset(dataset_meta=DatasetMeta(dataset_id, split=split))))
    meta = DatasetMeta(dataset_id, split=split, data_slice=None if pairs is None else range(pairs))
    dataset = Dataset(dataset_meta=meta)
    dataset.set_template(
        template_cls, model_id=model_id, max_length=max_length, truncation_strategy=truncation_strategy
    )
    dataset.map(processor)
    dataset.encode()
    model = checkpoint_model(folder, model_id)
    model.set_loss(loss)
    with_reference = "ref_logps" in loss.extra_inputs
    beta = getattr(loss, "beta", None)  # the rewards' scale, as the loss's own
    model.add_metric(DPOMetric, **({"beta": beta} if beta is not None else {}))
    for batch in DataLoader(dataset=dataset, batch_size=batch_size):
        ref = model.forward_only(inputs=batch, disable_lora=True) if with_reference else None
        model.forward_only(inputs=batch, ref_outputs=ref)
        model.calculate_loss()
    return model.calculate_metric(is_training=False)


def print_pair_metrics(metrics: dict[str, Any]) -> None:
    """One line: the loss, and the reward accuracy and margin against the reference, or without
    one the share of pairs the loss prefers the chosen row of and the rows' mean log-probabilities."""
    if "reward_margin" in metrics:
        found = (
            f"reward accuracy {metrics['reward_accuracy']:.4f}, reward margin {metrics['reward_margin']:.4f}"
        )
    else:
        found = (
            f"pair accuracy {metrics['accuracy']:.4f}, chosen logps {metrics['chosen_logps']:.4f}, "
            f"rejected logps {metrics['rejected_logps']:.4f}"
        )
    print(f"eval loss {metrics['loss']:.4f}, {found} ({metrics['pairs']} pairs)", flush=True)
