"""Pinned losses: the contract's calls on the tiny model give exactly these numbers, with
``TransformersModel`` and with ``MultiLoraTransformersModel``.

A change that should not move the numbers (a refactor, a faster path that computes the same
products in the same order) keeps them bit-identical under the fixed seed; a change that should
move them updates the pins and says why. The numbers are one thread's, on CPU, in fp32 (the
tests' ``_one_thread`` fixture)."""

import pytest
import torch
from peft import LoraConfig

from twinkle.dataloader import DataLoader
from twinkle.kernel import kernelize
from twinkle.model import MultiLoraTransformersModel, TransformersModel

STEPS = 6
# the contract's LoRA defaults (--lora-rank 8 --lora-alpha 32 --lora-dropout 0.05, all linear)
CONTRACT_LORA = dict(
    r=8, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM"
)
OTHER_LORA = dict(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])

PLAIN = {
    "train": [
        6.404642345835861,
        6.393194790544181,
        6.413905788112331,
        6.374001639229911,
        6.389477199978298,
        6.377387551700368,
    ],
    "metric": [
        [6.400518381817741, 0.258497416973114, 0.006211180124223602],
        [6.389877483408938, 0.2603698968887329, 0.005376344086021506],
        [6.382390164780891, 0.315359503030777, 0.0],
    ],
    "eval": [6.363523990736095, 0.01834862385321101],
}
MULTI = {
    "a": [
        6.404642345835861,
        6.393194790544181,
        6.413586590741132,
        6.374556405203683,
        6.3881030612521705,
        6.377504236557904,
    ],
    "b": [
        6.404642345835861,
        6.387702678811961,
        6.4116318161423145,
        6.3703749520438055,
        6.383218129475911,
        6.363697725183823,
    ],
    "metric": [
        [6.400518381817741, 0.2980269193649292, 0.006211180124223602],
        [6.390084543535786, 0.26724231243133545, 0.005376344086021506],
        [6.381889957121049, 0.39438143372535706, 0.0],
    ],
    "eval": [-356.98651123046875, 6.362444396412701],
}


@pytest.fixture(scope="module")
def batches(dataset):
    return list(DataLoader(dataset, batch_size=2))[: STEPS + 2]


def contract_setup(model, name: str, steps: int) -> None:
    """The contract's adapter, Muon and cosine schedule (a window of 2 micro-batches)."""
    model.add_adapter_to_model(name, LoraConfig(**CONTRACT_LORA), gradient_accumulation_steps=2)
    model.set_optimizer("Muon", lr=1e-2, adapter_name=name, adjust_lr_fn="match_rms_adamw")
    model.set_lr_scheduler(
        "CosineWarmupScheduler", num_warmup_steps=1, num_training_steps=steps, adapter_name=name
    )


def metric_numbers(metric: dict) -> list[float]:
    return [metric["loss"], metric["grad_norm"], metric["accuracy"]]


def test_contract_losses_of_the_plain_model(tiny_model_dir, batches):
    model = kernelize(TransformersModel(str(tiny_model_dir)))
    torch.manual_seed(0)
    contract_setup(model, "default", STEPS)
    train, metrics = [], []
    for i, batch in enumerate(batches[:STEPS]):
        train.append(model.forward_backward(inputs=batch))
        model.clip_grad_and_step()
        if i % 2 == 1:
            metrics.append(metric_numbers(model.calculate_metric(is_training=True)))
    for batch in batches[STEPS:]:
        model.forward_only(inputs=batch)
        model.calculate_loss()
    evaluated = model.calculate_metric(is_training=False)
    got = {"train": train, "metric": metrics, "eval": [evaluated["loss"], evaluated["accuracy"]]}
    assert got == PLAIN


def test_contract_losses_of_two_slot_adapters(tiny_model_dir, batches):
    """Adapter ``a`` (the contract's) and ``b`` (rank 4, AdamW) interleaved on one model, then
    a mixed evaluation (``adapter_names=``) and one of ``a``."""
    model = MultiLoraTransformersModel(str(tiny_model_dir), max_loras=3, max_r=8)
    contract_setup(model, "a", STEPS)
    model.add_adapter_to_model("b", LoraConfig(**OTHER_LORA))
    model.set_optimizer("AdamW", lr=1e-2, adapter_name="b")
    losses = {"a": [], "b": []}
    metrics = []
    for i, batch in enumerate(batches[:STEPS]):
        for name in ("a", "b"):
            losses[name].append(model.forward_backward(inputs=batch, adapter_name=name))
            model.clip_grad_and_step(adapter_name=name)
        if i % 2 == 1:
            metrics.append(metric_numbers(model.calculate_metric(is_training=True, adapter_name="a")))
    mixed = model.forward_only(batches[STEPS], adapter_names=["a", "b"])
    evals = [float(mixed["logps"].sum())]
    for batch in batches[STEPS:]:
        model.forward_only(inputs=batch, adapter_name="a")
        model.calculate_loss()
    evals.append(model.calculate_metric(is_training=False, adapter_name="a")["loss"])
    got = {**losses, "metric": metrics, "eval": evals}
    assert got == MULTI
