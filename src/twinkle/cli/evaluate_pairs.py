"""``twinkle eval`` of a checkpoint trained with ``DPOLoss`` (its ``trainer_state.json`` says
``"loss": "DPOLoss"``): the DPO loss and ``DPOMetric`` of held-out preference pairs, evaluated as
``cookbook/rl/dpo_lora.py`` does, with the base model (the adapter off) as the reference.

The pairs: the bundled ``self-cognition-dpo`` set's ``eval`` split, or the first
``--eval-samples`` pairs of a set of your own (``--dataset-id``, the rows the cookbook held out).
The loss's ``beta``, ``loss_type``, ``sft_weight`` and ``label_smoothing`` are the run's."""

from pathlib import Path
from typing import Any

from twinkle.utils.errors import UserError

BUNDLED = "self-cognition-dpo"
PREFERENCE_LOSSES = ("DPOLoss",)  # the preference losses twinkle eval rebuilds from a run's settings
LOSS_SETTINGS = ("beta", "loss_type", "sft_weight", "label_smoothing")


def evaluate_pairs(
    folder: Path,
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
    loss_settings: dict[str, Any],
) -> dict[str, float]:
    """The eval loss and ``DPOMetric`` numbers of ``pairs`` held-out pairs (None: the bundled
    ``eval`` split whole) of ``dataset_id`` (None: the bundled set)."""
    from twinkle.cli.evaluate import checkpoint_model
    from twinkle.dataloader import DataLoader
    from twinkle.dataset import Dataset, DatasetMeta
    from twinkle.loss import DPOLoss
    from twinkle.metric import DPOMetric
    from twinkle.preprocessor import PreferenceProcessor, SelfCognitionDPOProcessor

    # built first: settings a hand edit broke stop here, before any model loads
    loss = DPOLoss(**{k: v for k, v in loss_settings.items() if k in LOSS_SETTINGS})
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
    model.add_metric(DPOMetric, beta=loss.beta)
    for batch in DataLoader(dataset=dataset, batch_size=batch_size):
        ref = model.forward_only(inputs=batch, disable_lora=True)
        model.forward_only(inputs=batch, ref_outputs=ref)
        model.calculate_loss()
    return model.calculate_metric(is_training=False)
