"""The adapter's training state beside its weights (optimizer, LR schedule): one writer
(``checkpoint.save.state_parts``) and one loader (``checkpoint.load.load_state_parts``), shared by
``resume_from_checkpoint`` and ``load(..., load_optimizer=True)``, so both restore the same state
and refuse a part that does not fit in the same line."""

import re
from pathlib import Path

import pytest
import torch

from twinkle.checkpoint import integrity, layout
from twinkle.dataloader import DataLoader
from twinkle.utils.errors import UserError


def _same(a, b) -> bool:
    """Equal state dicts: the same keys and structure, tensors bit for bit."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def _trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.model.named_parameters() if p.requires_grad}


def _fresh(make_model):
    model = make_model()
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=1, num_training_steps=8)
    return model


@pytest.fixture
def trained(make_model, dataset, tmp_path):
    """A model after two optimizer steps, and its save (weights, optimizer, schedule)."""
    model = _fresh(make_model)
    for _, batch in zip(range(2), DataLoader(dataset, batch_size=2), strict=False):
        model.forward_backward(inputs=batch)
        assert model.clip_grad_and_step()
    return model, model.save("ck", output_dir=str(tmp_path))


def test_resume_and_load_restore_the_same_optimizer_and_schedule(trained, make_model):
    model, folder = trained
    group = model.optimizer_group["default"]
    assert {p.name for p in folder.iterdir()} >= {layout.OPTIMIZER, layout.SCHEDULER}
    resumed, loaded = _fresh(make_model), _fresh(make_model)
    assert not _same(resumed.optimizer_group["default"].optimizer.state_dict(), group.optimizer.state_dict())
    resumed.resume_from_checkpoint(str(folder))
    loaded.load(str(folder), load_optimizer=True)
    for other in (resumed, loaded):
        parts = other.optimizer_group["default"]
        assert _same(parts.optimizer.state_dict(), group.optimizer.state_dict())
        assert _same(parts.lr_scheduler.state_dict(), group.lr_scheduler.state_dict())
        assert parts.optimizer.param_groups[0]["lr"] == group.optimizer.param_groups[0]["lr"]


def test_save_without_the_optimizer_writes_the_schedule_only(make_model, tmp_path):
    model = _fresh(make_model)
    folder = model.save("ck", output_dir=str(tmp_path), save_optimizer=False)
    names = {p.name for p in folder.iterdir()}
    assert layout.SCHEDULER in names and layout.OPTIMIZER not in names


MISFITS = {
    "schedule-step-as-text": (
        layout.SCHEDULER,
        {"last_epoch": "ten"},
        r"does not fit this run's LR schedule \('last_epoch' is a str, not a int\)",
    ),
    "optimizer-of-another-model": (
        layout.OPTIMIZER,
        {"state": {}, "param_groups": [{"params": [0]}]},
        r"does not fit this run's optimizer \(",
    ),
}


@pytest.mark.parametrize("case", list(MISFITS))
def test_a_part_that_does_not_fit_is_the_same_line_from_resume_and_load(case, trained, make_model):
    _, folder = trained
    name, data, pattern = MISFITS[case]
    torch.save(data, folder / name)
    (folder / layout.MARKER).write_text(integrity.marker_text(folder))  # resealed, as anyone can
    messages = []
    for load in (
        lambda m: m.resume_from_checkpoint(str(folder)),
        lambda m: m.load(str(folder), load_optimizer=True),
    ):
        model = _fresh(make_model)
        before = _trainable(model)
        with pytest.raises(UserError) as exc:
            load(model)
        messages.append(str(exc.value))
        after = _trainable(model)
        assert all(torch.equal(before[n], after[n]) for n in before)  # the weights were not replaced
    assert messages[0] == messages[1] and "\n" not in messages[0]
    assert re.match(rf"{re.escape(str(Path(folder) / name))} {pattern}", messages[0]), messages[0]
